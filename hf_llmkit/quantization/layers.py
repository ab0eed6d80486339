"""Modules that replace `nn.Linear` / `nn.Embedding`: trainable DKM layers and packed inference layers.

`DKMLinear` / `DKMEmbedding` keep the latent weight (trainable) and a centroid table (`centroids`, `[G, K, d]`),
and with `scale_block_size` the absmax scale of every block of input features (`scales`, `[rows, cols / block]`): the
table then clusters the weight divided by its scales, and the clustered weight is multiplied back.
In training mode (with a weight that requires grad) the forward uses DKM's soft assignment, computed by one of
four engines (see `_soft`); otherwise it uses the hard assignment. `PalettizedLinear` / `PalettizedEmbedding` are
what a compact checkpoint reloads into: packed n-bit indices (`weight_packed`, uint8), the lookup table
(`weight_lut`, in `lut_dtype`) and the block scales (`weight_scale`, in `lut_dtype`) when there are any.

State dicts: a DKM layer's own is `weight`, `centroids` (+ `scales`, `bias`). A checkpoint written by `save_pretrained`
holds `weight_packed` + `weight_lut` (+ `weight_scale`) instead (compact), plus the layer's own while
`keep_training_state` is set (so a Trainer checkpoint resumes bitwise, see `DKMTrainingStateCallback`). Load-state-dict
pre-hooks accept all of these.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hf_llmkit.compat.torch import apply_keeping_dtypes, version_counter
from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.quantization import engines, lut_gemv, steps
from hf_llmkit.quantization._packing import pack_indices, packed_numel, unpack_indices
from hf_llmkit.quantization.config import DKMConfig
from hf_llmkit.quantization.engines.table import make_shard_group
from hf_llmkit.quantization.lut_gemv import compute_dtype
from hf_llmkit.quantization.marshal import MarshalHooks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DKMSettings:
    """What one DKM layer clusters with: its `DKMConfig` (where every option is declared, once) and what the layer's
    kind and shape decide, its index bits (embeddings have their own) and number of tables."""

    config: DKMConfig
    bits: int
    groups: int

    @classmethod
    def from_config(cls, config: DKMConfig, kind: str, rows: int) -> DKMSettings:
        """Settings of a `kind` ("linear" / "embedding") layer with `rows` output channels (embedding rows)."""
        return cls(config=config, bits=config.bits_for(kind), groups=config.num_groups(rows))

    @classmethod
    def build(cls, rows: int, *, groups: int = 1, kind: str = "linear", **options) -> DKMSettings:
        """Settings of a standalone layer with `rows` output channels, `groups` tables (`rows / groups` channels
        each) and the `DKMConfig` options given (e.g. `DKMSettings.build(64, bits=4, cluster_dim=2)`)."""
        if groups > 1:
            options.update(granularity="per_grouped_channel", group_size=rows // groups)
        return cls.from_config(DKMConfig(**options), kind, rows)

    @property
    def cluster_dim(self) -> int:
        return self.config.cluster_dim

    @property
    def scale_block(self) -> int:
        """Input features per block scale (0: the weights are clustered unscaled)."""
        return self.config.scale_block_size

    def scales_shape(self, shape) -> tuple[int, int] | None:
        """Shape of the block scales of a `[rows, cols]` weight (None without scales)."""
        return (shape[0], shape[1] // self.scale_block) if self.scale_block else None


def check_table(name: str, table: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A lookup table / centroid table must have the layer's shape and only finite values."""
    if tuple(table.shape) != shape:
        raise ValueError(f"{name!r} has shape {tuple(table.shape)}, expected {shape}; the checkpoint does not match.")
    if not bool(torch.isfinite(table).all()):
        raise ValueError(f"{name!r} holds NaN/Inf values: the checkpoint is corrupt; restore it from a good copy.")


def check_scales(name: str, scales: torch.Tensor | None, shape: tuple[int, int]) -> None:
    """Block scales must be present (the config has `scale_block_size`), of the layer's shape, finite and > 0."""
    if scales is None:
        raise ValueError(
            f"The DKM checkpoint has no {name!r} but its quantization_config sets scale_block_size: set it to 0 "
            "in config.json if the checkpoint was saved without block scales."
        )
    check_table(name, scales, shape)
    if not bool((scales > 0).all()):
        raise ValueError(f"{name!r} holds scales <= 0: the checkpoint is corrupt; restore it from a good copy.")


class _Clustered:
    """Shared by the two DKM layers: the table, k-means init, soft and hard clustered weights, export, loading."""

    weight: nn.Parameter
    centroids: torch.Tensor
    settings: DKMSettings
    keep_training_state: bool | None = None  # also save `weight` + `centroids`? (None: undecided, saves compact)
    dense_forward: bool = False  # forward with the latent weight itself (`calibrate` reads the layers' inputs so)

    def _init_table(self, settings: DKMSettings, device) -> None:
        self.settings = settings
        # eDKM's shard group is made here, as the model is quantized (every rank builds its layers), never lazily
        self.shard_group = make_shard_group() if settings.config.shard else None
        k = 1 << settings.bits
        self.register_buffer("centroids", torch.zeros(settings.groups, k, settings.cluster_dim, device=device))
        scales = settings.scales_shape(self.weight.shape)
        self.register_buffer("scales", None if scales is None else torch.ones(scales, device=device))
        self._hard_cache: tuple | None = None
        self.dkm_step: steps.Step | None = None
        self.dkm_initialised = False
        self.register_load_state_dict_pre_hook(_accept_checkpoint_tensors)

    def _vectors(self, weight: torch.Tensor) -> torch.Tensor:
        return dkm.to_vectors(weight, self.settings.groups, self.settings.cluster_dim)

    def _normalized(self, weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """The weight the table clusters: `weight` itself, or divided by its block scales (float32)."""
        if scales is None:
            return weight
        return weight.float() / dkm.expand_scales(scales.float(), weight.shape[1])

    def fresh_scales(self, weight: torch.Tensor) -> torch.Tensor | None:
        """Block scales of `weight` as they are saved (None without scales)."""
        if not self.settings.scale_block:
            return None
        return dkm.block_scales(weight, self.settings.scale_block, self.settings.config.table_dtype)

    @property
    def table_shape(self) -> tuple[int, int, int]:
        return (self.settings.groups, 1 << self.settings.bits, self.settings.cluster_dim)

    @torch.no_grad()
    def init_centroids(self, weight: torch.Tensor | None = None) -> None:
        """k-means initialisation of the table from the (loaded) weight."""
        w = self.weight if weight is None else weight
        s = self.settings
        if s.scale_block:
            self.scales = self.fresh_scales(w).to(w.device)
        self.centroids = dkm.kmeans(
            self._vectors(self._normalized(w.detach(), self.scales)),
            1 << s.bits,
            s.config.kmeans_iters,
            s.config.kmeans_sample,
        ).to(w.device)
        self.dkm_initialised = True

    def lookup_table(self, centroids: torch.Tensor | None = None) -> torch.Tensor:
        """The table the hard assignment uses (float32): the centroids rounded to `lut_dtype`, as they are saved."""
        c = (self.centroids if centroids is None else centroids).detach()
        return c.to(self.settings.config.table_dtype).float()

    def lookup_scales(self, scales: torch.Tensor | None = None) -> torch.Tensor | None:
        """The block scales the hard assignment uses (float32, in `lut_dtype`'s values), None without scales."""
        s = self.scales if scales is None else scales
        return None if s is None else s.detach().to(self.settings.config.table_dtype).float()

    def hard_indices(
        self,
        weight: torch.Tensor | None = None,
        centroids: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Nearest-entry index of every (scaled) weight vector in the lookup table, `[G, n]` (of the layer's own
        weight, table and scales, or of the full ones given, e.g. gathered from FSDP2 shards)."""
        vectors, table, _ = self._hard_inputs(weight, centroids, scales)
        return dkm.hard_assign(vectors, table)

    def _hard_inputs(self, weight=None, centroids=None, scales=None):
        """(the weight vectors the table clusters, the lookup table, the lookup scales or None), on the weight's
        device: what the hard assignment reads."""
        w = (self.weight if weight is None else weight).detach()
        s = self.lookup_scales(scales)
        s = None if s is None else s.to(w.device)
        return self._vectors(self._normalized(w, s)), self.lookup_table(centroids).to(w.device), s

    def hard_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The hard-assigned weight (what evaluation, inference and the saved checkpoint use), cached."""
        tensors = [t for t in (self.weight, self.centroids, self.scales) if t is not None]
        key = (*((version_counter(t), t.data_ptr()) for t in tensors), dtype)
        if self._hard_cache is None or self._hard_cache[0] != key:
            vectors, table, scales = self._hard_inputs()
            w = dkm.hard_decode(vectors, table, self.weight.shape, scales)
            self._hard_cache = (key, w.to(dtype))
        return self._hard_cache[1]

    def export(
        self,
        weight: torch.Tensor | None = None,
        centroids: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """`{"weight_packed", "weight_lut"(, "weight_scale")}` of the hard assignment, as a compact checkpoint stores
        them (of the full `weight` / `centroids` / `scales` given instead of the layer's own, see `hard_indices`);
        table and scales in `lut_dtype`."""
        table, dtype = self.lookup_table(centroids), self.settings.config.table_dtype
        out = {
            "weight_packed": pack_indices(self.hard_indices(weight, table, scales), self.settings.bits),
            "weight_lut": table.to(dtype).clone(),
        }
        if self.settings.scale_block:
            out["weight_scale"] = self.lookup_scales(scales).to(dtype).clone()
        return out

    def _use_soft(self) -> bool:
        return self.training and torch.is_grad_enabled() and self.weight.requires_grad

    def _trained_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        """A straight-through training forward (`training_forward`, by default `recipe="calibrated"`'s): the
        hard-assigned weight (evaluation's and the saved model's, bit for bit) with a straight-through gradient to the
        latent weight; None otherwise. DKM's soft assignment would blend two entries for the many GPTQ-compensated
        latent weights between them: training would optimise that blend, not the rounded model (docs/dkm.md)."""
        if not self.settings.config.straight_through or not self._use_soft():
            return None
        return self.hard_weight(dtype) + (self.weight - self.weight.detach()).to(dtype)  # adds an exact zero

    def _soft(self, x: torch.Tensor | None) -> torch.Tensor:
        """Soft-clustered `x @ W_c^T` (Linear) or `W_c` (x is None), updating the centroids (DKM keeps them).

        The engine (`engines.resolve`) computes DKM's soft assignment. Under autocast the product runs in autocast's
        dtype, like `F.linear` (`x` is cast, `W_c` follows it), while DKM itself (latent weight, centroids,
        attention, k-means sums) keeps the weight's and the tables' precision: autocast is off inside, so no engine
        op is silently recast and forward and backward dtypes agree.
        """
        cfg = self.settings.config
        if x is not None:
            x = x.to(compute_dtype(x))
        marshal = MarshalHooks(offload=True, exclude=() if x is None else (x,)) if cfg.offload else None
        device = self.weight.device.type
        with marshal if marshal is not None else contextlib.nullcontext(), torch.autocast(device, enabled=False):
            start = steps.start_of_step(self, self._vectors(self.weight))  # the same for every forward of a step
            if self.scales is None:
                result, cents = engines.soft_cluster(x, self.weight, start, self.settings, self.shard_group)
            else:
                result, cents = self._soft_scaled(x, start)
        steps.finish_forward(self, cents)
        self.last_marshal = marshal.stats if marshal is not None else None
        return result

    def _soft_scaled(self, x: torch.Tensor | None, start: torch.Tensor):
        """The soft assignment with block scales: the table clusters `W / s` (the scales of the current latent
        weight, kept in `scales`, or with `recipe="calibrated"` the kept ones; constants to autograd) and the
        clustered weight is `s` times it."""
        scales = self.scales
        if self.settings.config.recipe != "calibrated":  # that recipe keeps its start's scales, the table's units
            scales = self.fresh_scales(self.weight)
            with torch.no_grad():
                self.scales.copy_(scales)
        return engines.soft_cluster(x, self.weight, start, self.settings, self.shard_group, scales=scales)


def _accept_checkpoint_tensors(module, state_dict, prefix, *_args) -> None:
    """Load-state-dict pre-hook of the DKM layers: take a checkpoint's training state, or rebuild from a compact one.

    - `weight` + `centroids` present (a Trainer checkpoint written with `keep_training_state`): they load as they
      are, bit for bit, with the optimizer step's `step_start` / `step_key` (`steps.py`); the packed copy next to
      them is dropped.
    - only `weight_packed` + `weight_lut` (a compact checkpoint): the latent weight restarts from the hard-assigned
      weight and the table from the lookup table (a warning says a resumed run will not match bit for bit).
    Tables must be complete and finite; anything else is a ValueError naming the tensor.
    """
    packed = state_dict.pop(prefix + "weight_packed", None)
    lut = state_dict.pop(prefix + "weight_lut", None)
    scale = state_dict.pop(prefix + "weight_scale", None)
    steps.take_step_state(module, state_dict, prefix)
    shape, scales_shape = module.table_shape, module.settings.scales_shape(module.weight.shape)
    if prefix + "centroids" in state_dict:
        check_table(prefix + "centroids", state_dict[prefix + "centroids"], shape)
        if scales_shape is not None:
            check_scales(prefix + "scales", state_dict.get(prefix + "scales"), scales_shape)
        module.dkm_initialised = True
        return
    if packed is None and lut is None:
        return
    if packed is None or lut is None:
        missing = prefix + ("weight_lut" if lut is None else "weight_packed")
        raise ValueError(f"The DKM checkpoint has no {missing!r} for {prefix.rstrip('.')!r}: it is incomplete.")
    check_table(prefix + "weight_lut", lut, shape)
    if scales_shape is not None:
        check_scales(prefix + "weight_scale", scale, scales_shape)
        state_dict[prefix + "scales"] = scale.float()
    s = module.settings
    idx = unpack_indices(packed, s.bits, module.weight.numel() // s.cluster_dim).reshape(s.groups, -1)
    weight = dkm.decode(lut, idx, module.weight.shape, None if scale is None else scale.float())
    state_dict[prefix + "weight"] = weight.to(module.weight.dtype)
    state_dict[prefix + "centroids"] = lut.float()
    module.dkm_initialised = True
    logger.warning(
        "%s: loaded from packed indices + lookup table; the latent weights restart from the hard assignment, so a "
        "resumed DKM run will not match an uninterrupted one bit for bit. Train with "
        "hf_llmkit.quantization.DKMTrainingStateCallback to keep the training state in checkpoints.",
        prefix.rstrip(".") or type(module).__name__,
    )


# Buffers a dtype cast of the model (`.to(torch.float16)`) leaves in their dtype: the tables and block scales, as
# `from_pretrained(..., dtype=...)` leaves them (the saved checkpoint must match its config's `lut_dtype`).
TABLES = ("centroids", "scales", "weight_lut", "weight_scale")


class DKMLinear(nn.Linear, _Clustered):
    """`nn.Linear` whose weight is clustered by DKM during training (soft) and hard-assigned otherwise."""

    def _apply(self, fn, recurse=True):
        return apply_keeping_dtypes(self, lambda: super(DKMLinear, self)._apply(fn, recurse), TABLES)

    def __init__(
        self, in_features: int, out_features: int, bias: bool, settings: DKMSettings, device=None, dtype=None
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_table(settings, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_forward:
            return F.linear(x, self.weight.to(compute_dtype(x)), self.bias)
        trained = self._trained_weight(compute_dtype(x))
        if trained is not None:
            return F.linear(x, trained, self.bias)
        if self._use_soft():
            y = self._soft(x)
            return y + self.bias.to(y.dtype) if self.bias is not None else y
        return F.linear(x, self.hard_weight(compute_dtype(x)), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.settings.bits}, groups={self.settings.groups}"


class DKMEmbedding(nn.Embedding, _Clustered):
    """`nn.Embedding` whose table rows are clustered by DKM (the eDKM paper uses 8 bits for embeddings)."""

    def _apply(self, fn, recurse=True):
        return apply_keeping_dtypes(self, lambda: super(DKMEmbedding, self)._apply(fn, recurse), TABLES)

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx, settings: DKMSettings, device=None, dtype=None
    ):
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, device=device, dtype=dtype)
        self._init_table(settings, device)

    def clustered_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The table this layer looks rows up in (and a tied LM head multiplies by, `tied.TiedDKMHead`): soft-clustered
        in training, else the hard assignment, in `dtype` (the soft one in the weight's dtype)."""
        weight = self._trained_weight(dtype)
        if weight is None:
            weight = self._soft(None) if self._use_soft() else self.hard_weight(dtype)
        return weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.clustered_weight(self.weight.dtype)
        return F.embedding(ids, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq)


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
