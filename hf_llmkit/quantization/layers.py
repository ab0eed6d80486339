"""Modules that replace `nn.Linear` / `nn.Embedding`: trainable DKM layers and packed inference layers.

`DKMLinear` / `DKMEmbedding` keep the latent weight (trainable) and a centroid table (`centroids`, `[G, K, d]`).
In training mode (with a weight that requires grad) the forward uses DKM's soft assignment, through eDKM's unique
table when `uniquify`/`shard` are set and inside `MarshalHooks` when `offload` is set; otherwise it uses the hard
assignment. `PalettizedLinear` / `PalettizedEmbedding` are what a saved checkpoint reloads into: packed n-bit
indices (`weight_packed`, uint8) and the lookup table (`weight_lut`, float32).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hf_llmkit.quantization import dkm, edkm
from hf_llmkit.quantization.marshal import MarshalHooks
from hf_llmkit.quantization.packing import pack_indices, packed_numel, unpack_indices

_SHARD_GROUP: dict[str, object] = {}


@dataclass(frozen=True)
class DKMSettings:
    """Per-layer clustering settings, derived from a `DKMConfig` and the layer's kind."""

    bits: int
    cluster_dim: int
    groups: int
    kmeans_iters: int = 12
    kmeans_sample: int = 65536
    dkm_iters: int = 3
    temperature: float = 0.02
    epsilon: float = 1e-4
    uniquify: bool = True
    shard: bool = False
    offload: bool = True

    @classmethod
    def from_config(cls, config, kind: str, rows: int) -> DKMSettings:
        return cls(
            bits=config.bits_for(kind),
            cluster_dim=config.cluster_dim,
            groups=config.num_groups(rows),
            kmeans_iters=config.kmeans_iters,
            kmeans_sample=config.kmeans_sample,
            dkm_iters=config.dkm_iters,
            temperature=config.temperature,
            epsilon=config.epsilon,
            uniquify=config.uniquify,
            shard=config.shard,
            offload=config.offload,
        )


def shard_group():
    """A process group of all ranks, dedicated to eDKM sharding (kept apart from DDP's gradient buckets)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if "group" not in _SHARD_GROUP:
        _SHARD_GROUP["group"] = dist.new_group(ranks=list(range(dist.get_world_size())))
    return _SHARD_GROUP["group"]


class _Clustered:
    """Shared by the two DKM layers: the table, k-means init, soft and hard clustered weights, export."""

    weight: nn.Parameter
    centroids: torch.Tensor
    settings: DKMSettings

    def _init_table(self, settings: DKMSettings, device) -> None:
        self.settings = settings
        k = 1 << settings.bits
        self.register_buffer("centroids", torch.zeros(settings.groups, k, settings.cluster_dim, device=device))
        self._hard_cache: tuple | None = None
        self.dkm_initialised = False

    def _vectors(self, weight: torch.Tensor) -> torch.Tensor:
        return dkm.to_vectors(weight, self.settings.groups, self.settings.cluster_dim)

    @torch.no_grad()
    def init_centroids(self, weight: torch.Tensor | None = None) -> None:
        """k-means initialisation of the table from the (loaded) weight."""
        w = self.weight if weight is None else weight
        s = self.settings
        self.centroids = dkm.kmeans(self._vectors(w.detach()), 1 << s.bits, s.kmeans_iters, s.kmeans_sample).to(
            w.device
        )
        self.dkm_initialised = True

    def hard_indices(self) -> torch.Tensor:
        """Nearest-centroid index of every weight vector, `[G, n]`."""
        return dkm.hard_assign(self._vectors(self.weight.detach()), self.centroids)

    def hard_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The hard-assigned weight (what evaluation, inference and the saved checkpoint use), cached."""
        key = (self.weight._version, self.weight.data_ptr(), self.centroids._version, self.centroids.data_ptr(), dtype)
        if self._hard_cache is None or self._hard_cache[0] != key:
            w = dkm.lookup(self.centroids, self.hard_indices()).reshape(self.weight.shape).to(dtype)
            self._hard_cache = (key, w)
        return self._hard_cache[1]

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(`weight_packed`, `weight_lut`) of the hard assignment, as a checkpoint stores them."""
        return pack_indices(self.hard_indices(), self.settings.bits), self.centroids.detach().float().clone()

    def _accept_packed(self, state_dict: dict, prefix: str) -> None:
        """Let a packed checkpoint (e.g. a Trainer checkpoint being resumed) load into this trainable layer: the
        latent weight restarts from the hard-assigned weight and the table from the lookup table."""
        packed = state_dict.pop(prefix + "weight_packed", None)
        lut = state_dict.pop(prefix + "weight_lut", None)
        if packed is None or lut is None:
            return
        s = self.settings
        idx = unpack_indices(packed, s.bits, self.weight.numel() // s.cluster_dim).reshape(s.groups, -1)
        state_dict[prefix + "weight"] = dkm.lookup(lut.float(), idx).reshape(self.weight.shape).to(self.weight.dtype)
        state_dict[prefix + "centroids"] = lut.float()
        self.dkm_initialised = True

    def _use_soft(self) -> bool:
        return self.training and torch.is_grad_enabled() and self.weight.requires_grad

    def _soft(self, x: torch.Tensor | None) -> torch.Tensor:
        """Soft-clustered `x @ W_c^T` (Linear) or `W_c` (x is None), updating the centroids (DKM keeps them)."""
        s = self.settings
        group = shard_group() if s.shard else None
        marshal = MarshalHooks(offload=True, exclude=() if x is None else (x,)) if s.offload else None
        with marshal if marshal is not None else contextlib.nullcontext():
            if not s.uniquify and group is None:
                vec = self._vectors(self.weight)
                std = dkm.group_std(vec)
                out, cents = dkm.soft_dkm(vec, self.centroids, s.temperature * std, s.dkm_iters, s.epsilon * std)
                w_c = out.reshape(self.weight.shape).to(x.dtype if x is not None else self.weight.dtype)
                result = w_c if x is None else x @ w_c.t()
            else:
                table = edkm.build_table(self.weight, s.groups, s.cluster_dim, s.uniquify)
                std = edkm.table_std(table)
                values = edkm.TableValues.apply(
                    self.weight, table.values, table.counts, table.inverse, table.mode, s.groups, s.cluster_dim
                )
                out, jac, cents = edkm.table_dkm(
                    values, table, self.centroids, s.temperature * std, s.epsilon * std, s.dkm_iters, group
                )
                result = edkm.PaletteApply.apply(
                    x, out, jac, self.weight, table.inverse, table.mode, s.groups, s.cluster_dim
                )
        with torch.no_grad():
            self.centroids.copy_(cents.detach())
        self.last_marshal = marshal.stats if marshal is not None else None
        return result


class DKMLinear(nn.Linear, _Clustered):
    """`nn.Linear` whose weight is clustered by DKM during training (soft) and hard-assigned otherwise."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, settings: DKMSettings, device=None, dtype=None
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_table(settings, device)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._accept_packed(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_soft():
            y = self._soft(x)
            return y + self.bias.to(y.dtype) if self.bias is not None else y
        return F.linear(x, self.hard_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.settings.bits}, groups={self.settings.groups}"


class DKMEmbedding(nn.Embedding, _Clustered):
    """`nn.Embedding` whose table rows are clustered by DKM (the eDKM paper uses 8 bits for embeddings)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx, settings: DKMSettings, device=None, dtype=None
    ):
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, device=device, dtype=dtype)
        self._init_table(settings, device)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._accept_packed(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self._soft(None) if self._use_soft() else self.hard_weight(self.weight.dtype)
        return F.embedding(ids, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq)


class _Packed(nn.Module):
    """Packed indices + lookup table of one weight; decoded on the fly at each forward."""

    def _init_packed(self, shape: tuple[int, int], settings: DKMSettings, device) -> None:
        self.settings, self.weight_shape = settings, shape
        count = shape[0] * shape[1] // settings.cluster_dim
        k = 1 << settings.bits
        self.register_buffer(
            "weight_packed", torch.zeros(packed_numel(count, settings.bits), dtype=torch.uint8, device=device)
        )
        self.register_buffer("weight_lut", torch.zeros(settings.groups, k, settings.cluster_dim, device=device))

    def check_packed(self, name: str) -> None:
        """Raise a ValueError when the loaded tensors do not match the config this layer was built from."""
        s = self.settings
        count = self.weight_shape[0] * self.weight_shape[1] // s.cluster_dim
        want_packed = (packed_numel(count, s.bits),)
        want_lut = (s.groups, 1 << s.bits, s.cluster_dim)
        got_packed, got_lut = tuple(self.weight_packed.shape), tuple(self.weight_lut.shape)
        if self.weight_packed.dtype != torch.uint8 or got_packed != want_packed or got_lut != want_lut:
            raise ValueError(
                f"The DKM checkpoint does not match its quantization_config at {name!r}: expected weight_packed "
                f"uint8 {want_packed} and weight_lut {want_lut} (bits={s.bits}, cluster_dim={s.cluster_dim}, "
                f"{s.groups} table(s)), found {self.weight_packed.dtype} {got_packed} and {got_lut}. Re-export the "
                "checkpoint, or fix 'bits'/'cluster_dim'/'granularity'/'group_size' in its config.json."
            )

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        s = self.settings
        count = self.weight_shape[0] * self.weight_shape[1] // s.cluster_dim
        idx = unpack_indices(self.weight_packed, s.bits, count).reshape(s.groups, -1)
        return dkm.lookup(self.weight_lut, idx).reshape(self.weight_shape).to(dtype)


class PalettizedLinear(_Packed):
    """Inference `Linear` of a saved DKM checkpoint."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, settings: DKMSettings, device=None, dtype=None
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._init_packed((out_features, in_features), settings, device)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)


class PalettizedEmbedding(_Packed):
    """Inference `Embedding` of a saved DKM checkpoint."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx, settings: DKMSettings, device=None, dtype=None
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.dtype = dtype or torch.get_default_dtype()
        self._init_packed((num_embeddings, embedding_dim), settings, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.dequantized_weight(self.dtype), self.padding_idx)
