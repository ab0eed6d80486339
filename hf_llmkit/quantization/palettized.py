"""The packed inference layers a compact DKM checkpoint reloads into: `PalettizedLinear` / `PalettizedEmbedding`.

They keep the checkpoint's tensors as saved, with no decoded copy: packed n-bit indices (`weight_packed`, uint8), the
lookup table (`weight_lut`, in `lut_dtype`) and the block scales (`weight_scale`, in `lut_dtype`) when there are any;
`lut_gemv` multiplies by them. A load-state-dict pre-hook drops a training checkpoint's extra tensors (the trainable
layers' own, see `layers.py`) and checks the tables. `trainable_from_packed` (`integration.py`) makes them trainable.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_llmkit.compat.torch import apply_keeping_dtypes
from hf_llmkit.quantization import lut_gemv, steps
from hf_llmkit.quantization._packing import packed_numel
from hf_llmkit.quantization.layer_settings import TABLES, DKMSettings, check_scales, check_table


class _Packed(nn.Module):
    """Packed indices + lookup table of one weight, kept as saved (no decoded copy); `lut_gemv` multiplies by it."""

    def _apply(self, fn, recurse=True):
        return apply_keeping_dtypes(self, lambda: super(_Packed, self)._apply(fn, recurse), TABLES)

    def _init_packed(self, shape: tuple[int, int], settings: DKMSettings, device) -> None:
        self.settings, self.weight_shape = settings, shape
        k = 1 << settings.bits
        self.register_buffer(
            "weight_packed", torch.zeros(packed_numel(self.count, settings.bits), dtype=torch.uint8, device=device)
        )
        table = torch.zeros(settings.groups, k, settings.cluster_dim, device=device, dtype=settings.config.table_dtype)
        self.register_buffer("weight_lut", table)
        scales = settings.scales_shape(shape)
        dtype = settings.config.table_dtype
        scale = None if scales is None else torch.ones(scales, device=device, dtype=dtype)
        self.register_buffer("weight_scale", scale)
        self.register_load_state_dict_pre_hook(_check_packed_tensors)

    @property
    def count(self) -> int:
        """Indices stored: one per weight vector."""
        return self.weight_shape[0] * self.weight_shape[1] // self.settings.cluster_dim

    def check_packed(self, name: str) -> None:
        """Raise a ValueError naming the tensor when the loaded tensors do not match the config or are corrupt.

        Indices are in range by construction once the shapes match: a `bits`-bit field addresses exactly the
        `2**bits` rows of the table. The padding bits after the last index must be zero, as `pack_indices` writes them.
        """
        s = self.settings
        want_packed = (packed_numel(self.count, s.bits),)
        want_lut = (s.groups, 1 << s.bits, s.cluster_dim)
        got_packed, got_lut = tuple(self.weight_packed.shape), tuple(self.weight_lut.shape)
        if self.weight_packed.dtype != torch.uint8 or got_packed != want_packed or got_lut != want_lut:
            raise ValueError(
                f"The DKM checkpoint does not match its quantization_config at {name!r}: expected weight_packed "
                f"uint8 {want_packed} and weight_lut {want_lut} (bits={s.bits}, cluster_dim={s.cluster_dim}, "
                f"{s.groups} table(s)), found {self.weight_packed.dtype} {got_packed} and {got_lut}. Re-export the "
                "checkpoint, or fix 'bits'/'cluster_dim'/'granularity'/'group_size' in its config.json."
            )
        check_table(f"{name}.weight_lut", self.weight_lut, want_lut)
        if self.weight_scale is not None:
            check_scales(f"{name}.weight_scale", self.weight_scale, s.scales_shape(self.weight_shape))
        pad = (-self.count * s.bits) % 8
        if pad and int(self.weight_packed[-1]) >> (8 - pad):
            raise ValueError(f"{name + '.weight_packed'!r} has non-zero padding bits: the checkpoint is corrupt.")

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The decoded dense weight in `dtype` (the hard assignment's, bit for bit)."""
        return lut_gemv.decode_weight(self, dtype)

    def extra_repr(self) -> str:
        # peft prints the module it cannot adapt: the repr names the way to train adapters on it
        rows, cols = self.weight_shape
        return (f"{cols} -> {rows}, {self.settings.bits}-bit packed DKM layer; adapters train on it after "
                "hf_llmkit.quantization.trainable_from_packed(model)")  # fmt: skip


def _check_packed_tensors(module, state_dict, prefix, *_args) -> None:
    """Load-state-dict pre-hook of the packed layers: drop a training checkpoint's extra tensors, check the table."""
    for extra in ("weight", "centroids", "scales", *steps.STEP_NAMES):
        state_dict.pop(prefix + extra, None)
    lut = state_dict.get(prefix + "weight_lut")
    if lut is not None:
        check_table(prefix + "weight_lut", lut, tuple(module.weight_lut.shape))
    scale = state_dict.get(prefix + "weight_scale")
    if scale is not None and module.weight_scale is not None:
        check_scales(prefix + "weight_scale", scale, tuple(module.weight_scale.shape))


class PalettizedLinear(_Packed):
    """Inference `Linear` of a compact DKM checkpoint."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, settings: DKMSettings, device=None, dtype=None
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._init_packed((out_features, in_features), settings, device)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lut_gemv.linear(self, x, self.bias)


class PalettizedEmbedding(_Packed):
    """Inference `Embedding` of a compact DKM checkpoint."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx, settings: DKMSettings, device=None, dtype=None
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.dtype = dtype or torch.get_default_dtype()
        self._init_packed((num_embeddings, embedding_dim), settings, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the decoded table, read from their own index bits (no whole-table decode)."""
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"PalettizedEmbedding takes integer ids (int32/int64), got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"ids must lie in [0, {self.num_embeddings}), got {int(ids.min())}..{int(ids.max())}")
        return lut_gemv.decode_rows(self, ids).to(self.dtype)
