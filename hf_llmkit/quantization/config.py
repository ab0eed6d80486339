"""`DKMConfig`: the `quantization_config` of DKM / eDKM train-time weight clustering.

It travels through transformers like any built-in method: `from_pretrained(..., quantization_config=DKMConfig())`
quantizes on load, `save_pretrained` writes it into `config.json` (`quant_method: "dkm"`), and the saved dict is
rebuilt with `DKMConfig(**dict)` when the checkpoint is reloaded, so every saved key is an `__init__` argument.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from transformers.utils.quantization_config import QuantizationConfigMixin

from hf_llmkit.quantization import engines
from hf_llmkit.quantization.engines import ENGINES

GRANULARITIES = ("per_tensor", "per_grouped_channel")
LUT_DTYPES = ("float32", "float16", "bfloat16")
RECIPES = ("dkm", "calibrated")
TRAINING_FORWARDS = ("auto", "soft", "straight_through")
# recipe="calibrated": QAT from the best post-training state (the fields a user left at their defaults)
CALIBRATED_RECIPE = {"scale_block_size": 64, "lut_dtype": "float16", "calibration_refit": True,
                     "calibration_samples": 128, "dkm_iters": 0}  # fmt: skip
# ... and from 4 bits on, a tenth of the learning rate for the latent weights (their table's cells are narrow: at the
# full rate, 40 distillation steps re-rounded enough GPTQ-compensated weights to undo the start; docs/dkm.md)
CALIBRATED_NARROW_BITS, CALIBRATED_LATENT_LR_SCALE = 4, 0.1


@dataclass
class DKMConfig(QuantizationConfigMixin):
    """Configuration of differentiable k-means weight clustering (DKM, Cho et al. 2022) and its memory-efficient
    variant eDKM (Cho et al. 2023).

    Each target weight is replaced by a lookup table of `2**bits` centroids (of `cluster_dim` values each) and an
    n-bit index per weight vector. During training the layer uses DKM's soft assignment (attention over
    centroids, refined by a few differentiable k-means steps); in evaluation and after saving it uses the hard
    assignment.

    Args:
        bits (`int`, defaults to 3):
            Bits per index (1-8): each table has `2**bits` centroids.
        cluster_dim (`int`, defaults to 1):
            Length of the weight vectors that are clustered together (vector palettization); it must divide the
            input dimension of every converted layer.
        granularity (`str`, defaults to `"per_tensor"`):
            `"per_tensor"` (one table per weight) or `"per_grouped_channel"` (one table per `group_size` output
            channels).
        group_size (`int`, defaults to 32):
            Output channels sharing a table when `granularity="per_grouped_channel"`; it must divide the output
            dimension of every converted layer.
        lut_dtype (`str`, defaults to `"float32"`):
            Precision of the saved lookup tables: `"float32"`, `"float16"` or `"bfloat16"`. The hard assignment
            (evaluation, export) uses the table rounded to it, so a reloaded checkpoint computes exactly what the
            trained model does; 16 bits halve what a table per channel costs. Block scales are saved in it too.
        scale_block_size (`int`, defaults to 0):
            Input features per absmax scale (e.g. 64): each output channel's weights are divided, block by block,
            by their largest magnitude (rounded to `lut_dtype`), the table clusters those normalised weights, and a
            weight is `table[index] * scale`. GPTQ's per-group grid, with a learned table in place of a uniform one;
            it costs `16 / scale_block_size` bits per weight with 16-bit `lut_dtype`. 0 (no scales) clusters the
            weights themselves. Scalar tables only (`cluster_dim=1`); it must divide every converted layer's input
            dimension.
        calibration_samples (`int`, defaults to 0):
            At the end of each Trainer run, round the latent weights onto the trained tables with GPTQ's error
            compensation under the layer inputs of this many training examples (`hf_llmkit.quantization.calibrate`)
            instead of to the nearest entry; 0 keeps nearest-entry rounding.
        calibration_refit (`bool`, defaults to `False`):
            `calibrate` (and so `calibration_samples`) first refits each table by k-means on the calibration
            inputs' terms: every weight counts by its share of the layer's output error (the energy of its input
            feature, times its block scale squared), as SqueezeLLM's sensitivity-weighted k-means; then it rounds.
            For post-training use (no DKM training, or tables to replace); off keeps the trained tables.
        recipe (`str`, defaults to `"dkm"`):
            `"dkm"`: training starts from the k-means tables, DKM's iterations move them every forward. `"calibrated"`:
            quantization-aware training from the best post-training state, the one setting that asks for it. It
            fills in the fields left at their defaults with block scales per 64 inputs (`scale_block_size=64`),
            16-bit tables, `calibration_refit=True` and `calibration_samples=128`, and `DKMTrainingStateCallback`
            calibrates before the first step (refit tables, GPTQ-rounded latent weights); training then keeps the
            tables and block scales of that start (`dkm_iters=0`; DKM's centroid updates, weighted by the importance
            `calibrate` keeps, run with `recipe="dkm"` on a model calibrated by hand) and moves only the latent
            weights, whose nearest-entry rounding is the final model (no second calibration: it would take the
            trained latents for full-precision weights). Its training forward is that rounding itself, the saved
            model's forward, with straight-through gradients to the latent weights (DKM's soft assignment would blend
            the entries around GPTQ-compensated weights).
        training_forward (`str`, defaults to `"auto"`):
            What a training forward computes: `"soft"` (DKM's soft assignment: each weight a blend of the table's
            entries by its attention over them, at `temperature`), `"straight_through"` (the hard assignment,
            evaluation's and the saved model's forward, with straight-through gradients to the latent weights; the
            tables move only where DKM's iterations run, which they do not here), or `"auto"`: soft for
            `recipe="dkm"`, straight-through for `recipe="calibrated"` (measured better from that start:
            docs/dkm.md, "Soft assignment or straight-through").
        latent_lr_scale (`float`, defaults to 1.0):
            Factor on the learning rate of the DKM layers' latent weights, applied by `LLMKitTrainer` (and so the
            main jobs) and by `hf_llmkit.quantization.scale_latent_lr(optimizer, model)` in a loop of your own; a
            plain `Trainer` with `DKMTrainingStateCallback` trains them at the full rate and warns once. Left at 1.0,
            `recipe="calibrated"` sets 0.1 from 4 bits on (1.0 below).
        kmeans_iters (`int`, defaults to 50):
            Lloyd iterations of the k-means that initialises the tables after the weights are loaded (it stops
            once converged).
        kmeans_sample (`int`, defaults to 65536):
            At most this many weight vectors per table feed that k-means (a fixed-seed sample; all when fewer).
        dkm_iters (`int`, defaults to 3):
            Differentiable centroid-update iterations in each soft training forward: DKM's soft k-means means, every
            weight counted 1, or, on a layer `calibrate` ran on, by its input feature's energy times its block scale
            squared (the weighting its refit tables were fit by, so they stay near their start; issue 50). A
            calibrated start without that importance (a training checkpoint from before it was kept) refuses them in
            one line.
        temperature (`float`, defaults to 0.02):
            Softmax temperature of the soft assignment, in units of the table's weight standard deviation;
            smaller is closer to hard assignment.
        epsilon (`float`, defaults to 1e-4):
            Convergence tolerance of the centroid iterations (relative to the weight standard deviation); they
            stop early once no centroid moves more than this.
        modules_to_not_convert (`list[str]`, defaults to `["lm_head"]`):
            Module names (prefix, suffix or regex) kept in full precision. Tied weights are always kept.
        quantize_embeddings (`bool`, defaults to `False`):
            Also cluster `nn.Embedding` weights (the eDKM paper does, at 8 bits).
        embedding_bits (`int`, defaults to 8):
            Bits per index for embeddings when `quantize_embeddings` is set.
        uniquify (`bool`, defaults to `True`):
            eDKM weight uniquification: compute the attention table over the unique weight values (at most 65,536
            for 16-bit weights) and map it back through the inverse index.
        shard (`bool`, defaults to `False`):
            eDKM sharding: split that table across the ranks of the data-parallel group (needs
            `torch.distributed`; gradients must be averaged across the group, as DDP and the Trainer do).
        offload (`bool`, defaults to `True`):
            eDKM cross-device tensor marshaling: tensors saved for backward are stored once per storage (views are
            never copied twice) and, on an accelerator, moved to CPU until backward.
        engine (`str`, defaults to `"auto"`):
            How the soft assignment is computed (all compute the same function, see
            `hf_llmkit.quantization.engines`): `"naive"` (DKM as written, O(|W| K) memory), `"table"` (eDKM's
            unique-value table; 16-bit weights, vectors, sharding), `"interval"` (scalar weights in closed form,
            O(|W|) work for any number of tables), `"bucketed"` (float32 scalar weights in O(|W|) work, nothing
            weight-sized saved for backward), or `"auto"` (interval for finite float32 scalars, naive when
            `uniquify=False`, else table).
        quant_method (`str`, defaults to `"dkm"`):
            Fixed; saved in `config.json` so transformers finds this method again.
    """

    bits: int = field(default=3, metadata={"help": "Bits per index (1-8); each table has 2**bits centroids."})
    cluster_dim: int = field(
        default=1, metadata={"help": "Length of the clustered weight vectors; must divide each layer's input dim."}
    )
    granularity: str = field(
        default="per_tensor", metadata={"help": "'per_tensor' or 'per_grouped_channel' (one table per group_size)."}
    )
    group_size: int = field(
        default=32, metadata={"help": "Output channels per table for granularity='per_grouped_channel'."}
    )
    lut_dtype: str = field(
        default="float32", metadata={"help": "Saved lookup tables: 'float32', 'float16' or 'bfloat16'."}
    )
    scale_block_size: int = field(
        default=0, metadata={"help": "Input features per absmax scale of the clustered weights (0: no scales)."}
    )
    calibration_samples: int = field(
        default=0, metadata={"help": "Training examples that calibrate the final rounding (GPTQ onto the tables)."}
    )
    calibration_refit: bool = field(
        default=False, metadata={"help": "calibrate refits each table by input-energy-weighted k-means first."}
    )
    recipe: str = field(
        default="dkm",
        metadata={"help": "'dkm' or 'calibrated' (QAT from refit + GPTQ-calibrated tables, block scales, 16-bit)."},
    )
    training_forward: str = field(
        default="auto",
        metadata={"help": "'auto', 'soft' (DKM's attention) or 'straight_through' (the hard assignment + STE)."},
    )
    latent_lr_scale: float = field(
        default=1.0, metadata={"help": "Learning-rate factor of latent weights (recipe 'calibrated': 0.1 at 4+ bits)."}
    )
    kmeans_iters: int = field(default=50, metadata={"help": "Lloyd iterations of the k-means table initialisation."})
    kmeans_sample: int = field(
        default=65536, metadata={"help": "At most this many weight vectors per table feed the initial k-means."}
    )
    dkm_iters: int = field(default=3, metadata={"help": "Differentiable centroid updates per training forward."})
    temperature: float = field(
        default=0.02, metadata={"help": "Soft-assignment temperature, in units of the weight standard deviation."}
    )
    epsilon: float = field(
        default=1e-4, metadata={"help": "Convergence tolerance of the centroid updates (relative to weight std)."}
    )
    modules_to_not_convert: list[str] | None = field(
        default=None, metadata={"help": "Modules kept in full precision; None means ['lm_head']."}
    )
    quantize_embeddings: bool = field(default=False, metadata={"help": "Also cluster nn.Embedding weights."})
    embedding_bits: int = field(default=8, metadata={"help": "Bits per index for embeddings (1-8)."})
    uniquify: bool = field(default=True, metadata={"help": "eDKM: attention over unique weight values only."})
    shard: bool = field(default=False, metadata={"help": "eDKM: shard the unique table across data-parallel ranks."})
    offload: bool = field(
        default=True, metadata={"help": "eDKM: dedupe saved-for-backward storages; offload them on accelerators."}
    )
    engine: str = field(
        default="auto",
        metadata={"help": "Soft-assignment engine: 'auto', 'naive', 'table', 'bucketed' or 'interval' (same math)."},
    )
    quant_method: str = field(default="dkm", metadata={"help": "Fixed: 'dkm'."})

    def __post_init__(self) -> None:
        if self.quant_method != "dkm":
            raise ValueError(f"DKMConfig.quant_method must be 'dkm', got {self.quant_method!r}; leave it unset.")
        for name in ("bits", "embedding_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 8:
                raise ValueError(
                    f"DKMConfig.{name} must be an integer from 1 to 8 (2 to 256 centroids), got {value!r}."
                )
        if self.recipe not in RECIPES:
            raise ValueError(f"DKMConfig.recipe must be one of {RECIPES}, got {self.recipe!r}.")
        if self.training_forward not in TRAINING_FORWARDS:
            raise ValueError(
                f"DKMConfig.training_forward must be one of {TRAINING_FORWARDS}, got {self.training_forward!r}."
            )
        if self.recipe == "calibrated":
            self._fill_calibrated_recipe()
        positive = ("cluster_dim", "group_size", "kmeans_iters", "kmeans_sample")
        samples = self.calibration_samples
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"DKMConfig.calibration_samples must be an integer >= 0 (try 128), got {samples!r}.")
        if samples and self.cluster_dim != 1:
            raise ValueError("DKMConfig.calibration_samples needs scalar tables: use cluster_dim=1 or set it to 0.")
        block = self.scale_block_size
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            raise ValueError(f"DKMConfig.scale_block_size must be an integer >= 0 (try 64, or 0), got {block!r}.")
        if block and self.cluster_dim != 1:
            raise ValueError("DKMConfig.scale_block_size scales scalar weights: use cluster_dim=1 or set it to 0.")
        if not isinstance(self.calibration_refit, bool):
            raise ValueError(f"DKMConfig.calibration_refit must be True or False, got {self.calibration_refit!r}.")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DKMConfig.{name} must be a positive integer, got {value!r}.")
        if isinstance(self.dkm_iters, bool) or not isinstance(self.dkm_iters, int) or self.dkm_iters < 0:
            raise ValueError(f"DKMConfig.dkm_iters must be an integer >= 0, got {self.dkm_iters!r}.")
        if self.lut_dtype not in LUT_DTYPES:
            raise ValueError(f"DKMConfig.lut_dtype must be one of {LUT_DTYPES}, got {self.lut_dtype!r}.")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"DKMConfig.granularity must be one of {GRANULARITIES}, got {self.granularity!r}.")
        scale = self.latent_lr_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise ValueError(f"DKMConfig.latent_lr_scale must be a positive number (try 0.1), got {scale!r}.")
        if not self.temperature > 0:
            raise ValueError(f"DKMConfig.temperature must be > 0 (try 0.02), got {self.temperature!r}.")
        if not self.epsilon > 0:
            raise ValueError(f"DKMConfig.epsilon must be > 0 (try 1e-4), got {self.epsilon!r}.")
        if self.engine not in ENGINES:
            raise ValueError(f"DKMConfig.engine must be one of {ENGINES}, got {self.engine!r}.")
        reason = engines.unsupported(self.engine, None, self.cluster_dim, self.shard)  # the engines' own rules
        if reason is not None:
            raise ValueError(f"DKMConfig(engine={self.engine!r}) {reason}.")
        if self.modules_to_not_convert is None:
            self.modules_to_not_convert = ["lm_head"]
        elif isinstance(self.modules_to_not_convert, str):
            self.modules_to_not_convert = [self.modules_to_not_convert]
        self.modules_to_not_convert = list(self.modules_to_not_convert)

    def _fill_calibrated_recipe(self) -> None:
        """`recipe="calibrated"`: the fields still at their defaults take the recipe's values (idempotent, so a saved
        config rebuilds the same one; a field set otherwise is kept, except `dkm_iters`, which must be 0)."""
        defaults = {f.name: f.default for f in fields(self)}
        for name, value in CALIBRATED_RECIPE.items():
            if getattr(self, name) == defaults[name]:
                setattr(self, name, value)
        if self.latent_lr_scale == defaults["latent_lr_scale"]:
            self.latent_lr_scale = CALIBRATED_LATENT_LR_SCALE if self.bits >= CALIBRATED_NARROW_BITS else 1.0
        if self.dkm_iters != 0:
            raise ValueError(
                f"DKMConfig(recipe='calibrated') keeps its calibrated tables: set dkm_iters=0, got {self.dkm_iters}."
            )
        if self.cluster_dim != 1:
            raise ValueError("DKMConfig(recipe='calibrated') calibrates scalar tables: use cluster_dim=1.")

    @property
    def straight_through(self) -> bool:
        """Whether a training forward is the hard assignment with straight-through gradients (`training_forward`)."""
        if self.training_forward == "auto":
            return self.recipe == "calibrated"
        return self.training_forward == "straight_through"

    @property
    def table_dtype(self) -> torch.dtype:
        """The torch dtype of the saved lookup tables (`lut_dtype`)."""
        return getattr(torch, self.lut_dtype)

    def bits_for(self, kind: str) -> int:
        """Index bits of a converted module: `kind` is "linear" or "embedding"."""
        return self.embedding_bits if kind == "embedding" else self.bits

    def num_groups(self, rows: int) -> int:
        """Tables of a weight with `rows` output channels (rows of an embedding)."""
        return 1 if self.granularity == "per_tensor" else rows // self.group_size

    def check_shape(self, name: str, rows: int, cols: int) -> None:
        """Raise a ValueError naming the fix when a `[rows, cols]` weight cannot be clustered with this config."""
        if cols % self.cluster_dim:
            raise ValueError(
                f"DKMConfig.cluster_dim={self.cluster_dim} does not divide the input dimension {cols} of {name!r}; "
                f"use a cluster_dim that divides it or add {name!r} to modules_to_not_convert."
            )
        if self.scale_block_size and cols % self.scale_block_size:
            raise ValueError(
                f"DKMConfig.scale_block_size={self.scale_block_size} does not divide the input dimension {cols} of "
                f"{name!r}; use a scale_block_size that divides it or add {name!r} to modules_to_not_convert."
            )
        if self.granularity == "per_grouped_channel" and rows % self.group_size:
            raise ValueError(
                f"DKMConfig.group_size={self.group_size} does not divide the {rows} output channels of {name!r}; "
                f"use a group_size that divides it or add {name!r} to modules_to_not_convert."
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_diff_dict(self) -> dict[str, Any]:
        # Everything: a config.json must rebuild the same tables even if our defaults change later.
        return self.to_dict()
