"""The trainable DKM layers that replace `nn.Linear` / `nn.Embedding`: `DKMLinear` / `DKMEmbedding`.

They keep the latent weight (trainable) and a centroid table (`centroids`, `[G, K, d]`), and with `scale_block_size`
the absmax scale of every block of input features (`scales`, `[rows, cols / block]`): the table then clusters the
weight divided by its scales, and the clustered weight is multiplied back. In training mode (with a weight that
requires grad) the forward uses DKM's soft assignment, computed by one of four engines (see `_soft`); otherwise it
uses the hard assignment. What a compact checkpoint reloads into, `PalettizedLinear` / `PalettizedEmbedding`, is in
`palettized.py` (importable from here too); what both kinds are built from and checked against, `DKMSettings` and the
table checks, in `layer_settings.py`.

No training forward moves a layer off its start (issue 50): the block scales are recomputed from the latent weight
(`recipe="dkm"`'s soft forward) only where the layer's own k-means set them so (`start == "kmeans"`); scales that came
with a checkpoint or with `calibrate` are kept. DKM's centroid iterations weigh each weight by its input's importance
(`importance`, `H_jj` from `calibrate`'s input moments, times its block scale squared: what the calibrated tables were
refit by) where the layer has one, so they keep a calibrated table near its start; a calibrated start without it (a
checkpoint written before it was kept) refuses them in one line (`check_start`).

State dicts: a DKM layer's own is `weight`, `centroids` (+ `scales`, `bias`). A checkpoint written by `save_pretrained`
holds `weight_packed` + `weight_lut` (+ `weight_scale`) instead (compact), plus the layer's own while
`keep_training_state` is set (so a Trainer checkpoint resumes bitwise, see `DKMTrainingStateCallback`). Load-state-dict
pre-hooks accept all of these.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from hf_llmkit.compat.torch import apply_keeping_dtypes, version_counter
from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.quantization import engines, steps
from hf_llmkit.quantization._packing import pack_indices, unpack_indices
from hf_llmkit.quantization.engines.table import make_shard_group
from hf_llmkit.quantization.layer_settings import TABLES, DKMSettings, check_scales, check_table
from hf_llmkit.quantization.lut_gemv import compute_dtype
from hf_llmkit.quantization.marshal import MarshalHooks
from hf_llmkit.quantization.palettized import PalettizedEmbedding, PalettizedLinear

__all__ = [
    "TABLES",
    "DKMEmbedding",
    "DKMLinear",
    "DKMSettings",
    "PalettizedEmbedding",
    "PalettizedLinear",
    "check_scales",
    "check_table",
]

logger = logging.getLogger(__name__)

# Optimizer steps taken in this process, a key of the hard-weight cache: a fused optimizer (`torch.optim.AdamW(
# fused=True)`, the Trainer's default `adamw_torch_fused`) writes the parameters without moving their version counter
# (measured on torch 2.14), so a straight-through training forward kept decoding the first step's weights.
_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


class _Clustered:
    """Shared by the two DKM layers: the table, k-means init, soft and hard clustered weights, export, loading."""

    weight: nn.Parameter
    centroids: torch.Tensor
    settings: DKMSettings
    keep_training_state: bool | None = None  # also save `weight` + `centroids`? (None: undecided, saves compact)
    dense_forward: bool = False  # forward with the latent weight itself (`calibrate` reads the layers' inputs so)
    # Where the table and block scales came from (`steps.STARTS`): the layer's own k-means of the weights
    # (`init_centroids`), a checkpoint ("loaded") or `calibrate` ("calibrated"); saved with the training state.
    start: str = "kmeans"
    # Each input feature's importance in DKM's centroid updates, `[in_features]` float32 (`calibrate` sets the
    # diagonal of its input moments), None: uniform. A non-persistent buffer (it moves with the layer and keeps float32
    # through a dtype cast), saved with the training state only (`steps.step_state`), as the start kind is.
    importance: torch.Tensor | None

    def _init_table(self, settings: DKMSettings, device) -> None:
        self.settings = settings
        # eDKM's shard group is made here, as the model is quantized (every rank builds its layers), never lazily
        self.shard_group = make_shard_group() if settings.config.shard else None
        k = 1 << settings.bits
        self.register_buffer("centroids", torch.zeros(settings.groups, k, settings.cluster_dim, device=device))
        scales = settings.scales_shape(self.weight.shape)
        self.register_buffer("scales", None if scales is None else torch.ones(scales, device=device))
        self.register_buffer("importance", None, persistent=False)
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
        self.start = "kmeans"

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
        """The hard-assigned weight (what evaluation, inference and the saved checkpoint use), cached until the
        weight, table or scales change in place or move, or an optimizer steps (fused ones leave versions alone)."""
        tensors = [t for t in (self.weight, self.centroids, self.scales) if t is not None]
        key = (*((version_counter(t), t.data_ptr()) for t in tensors), dtype, _optimizer_steps)
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
        self.check_start()
        if x is not None:
            x = x.to(compute_dtype(x))
        marshal = MarshalHooks(offload=True, exclude=() if x is None else (x,)) if cfg.offload else None
        device = self.weight.device.type
        with marshal if marshal is not None else contextlib.nullcontext(), torch.autocast(device, enabled=False):
            start = steps.start_of_step(self, self._vectors(self.weight))  # the same for every forward of a step
            if self.scales is None:
                result, cents = engines.soft_cluster(
                    x, self.weight, start, self.settings, self.shard_group, importance=self.importance
                )
            else:
                result, cents = self._soft_scaled(x, start)
        steps.finish_forward(self, cents)
        self.last_marshal = marshal.stats if marshal is not None else None
        return result

    def check_start(self) -> None:
        """Refuse, in one line, a soft training forward whose centroid iterations would move a calibrated table off
        its start: without the layer's `importance` they are DKM's unweighted means, and `calibrate` fit the table
        (and rounded the latent weights) for the output error, so one forward took SmolLM2 from KL 0.645 to 3.06
        (issue 50). With it (what `calibrate` keeps) they weigh each weight as the table was fit."""
        iters = self.settings.config.dkm_iters
        if iters and self.start == "calibrated" and self.importance is None:
            raise ValueError(
                f"DKMConfig(dkm_iters={iters}) would move this layer's calibrated table off its start at the first "
                "step: it has no input importance to weigh DKM's centroid updates by (a checkpoint from before it was "
                "kept); run hf_llmkit.quantization.calibrate on the model again (it keeps it), or set dkm_iters=0"
            )

    def _recomputes_scales(self) -> bool:
        """Whether the soft forward recomputes the block scales from the latent weight: `recipe="dkm"` from the
        layer's own k-means start, whose rule that is; scales that came with a start (a checkpoint, `calibrate`,
        `recipe="calibrated"`) are the table's units and are kept."""
        return self.settings.config.recipe != "calibrated" and self.start == "kmeans"

    def _soft_scaled(self, x: torch.Tensor | None, start: torch.Tensor):
        """The soft assignment with block scales: the table clusters `W / s` (the scales of the current latent
        weight, kept in `scales`, or the start's kept ones: `_recomputes_scales`; constants to autograd) and the
        clustered weight is `s` times it."""
        scales = self.scales
        if self._recomputes_scales():
            scales = self.fresh_scales(self.weight)
            with torch.no_grad():
                self.scales.copy_(scales)
        return engines.soft_cluster(
            x, self.weight, start, self.settings, self.shard_group, scales=scales, importance=self.importance
        )


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
    module.start = "loaded"  # its scales are the checkpoint's, kept in training (the decoded weights' would differ)
    module.importance = None  # uniform: the decoded latent weights sit on their entries, which any weighing keeps
    logger.warning(
        "%s: loaded from packed indices + lookup table; the latent weights restart from the hard assignment, so a "
        "resumed DKM run will not match an uninterrupted one bit for bit. Train with "
        "hf_llmkit.quantization.DKMTrainingStateCallback to keep the training state in checkpoints.",
        prefix.rstrip(".") or type(module).__name__,
    )


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
