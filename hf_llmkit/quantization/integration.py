"""How DKM plugs into transformers' loading and saving (what `DKMHfQuantizer` delegates to).

- `replace_with_dkm_layers`: swap target `nn.Linear` / `nn.Embedding` modules for DKM layers (trainable, or packed
  inference layers for a compact checkpoint). Which one a checkpoint's layer loads is read from its tensor names
  before, in `layout.py` (`read_layout`).
- `DKMInitTables`: the load op that runs the k-means of each trainable layer as its weight arrives.
- `verify_loaded`: after loading, tables are finite and packed tensors have the config's shapes; a packed layer's
  bias the checkpoint lacks is initialised as transformers initialises a Linear's (`initialise_missing_biases`).
- `trainable_from_packed`: a model loaded from a compact checkpoint made trainable again (DKM training continues, or
  a PEFT adapter trains on it).
- `dkm_state_dict`: what `save_pretrained` writes: packed indices + lookup tables (compact), plus the latent weights
  and centroids of layers whose `keep_training_state` is set (Trainer checkpoints, see `training_state.py`); under
  FSDP2 / ZeRO-3, packed from the full state dict the Trainer gathered on every rank.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hf_llmkit.compat.transformers import (
    ConversionOps,
    get_module_from_name,
    initialise_missing_bias,
    loaded_by_from_pretrained,
    should_convert_module,
)
from hf_llmkit.quantization import engines, steps
from hf_llmkit.quantization.config import DKMConfig
from hf_llmkit.quantization.layer_settings import DKMSettings, check_scales, check_table
from hf_llmkit.quantization.layers import DKMEmbedding, DKMLinear
from hf_llmkit.quantization.layout import IMPORT_MARKER, SCALE_NAMES, TRAINING_NAMES
from hf_llmkit.quantization.palettized import PalettizedEmbedding, PalettizedLinear

TRAINABLE = (DKMLinear, DKMEmbedding)
PACKED = (PalettizedLinear, PalettizedEmbedding)


def stand_in_weight() -> torch.Tensor:
    """What a compact checkpoint holds under a packed layer's `weight`: one byte. transformers without hf_llmkit
    imported skips the unknown "dkm" method with a warning and would load such a model with freshly initialised
    weights where the packed ones are; a `weight` of the wrong size makes that load fail instead."""
    return torch.zeros(1, dtype=torch.uint8)


def tied_modules(model: nn.Module) -> list[str]:
    """Modules whose weight is tied to another's (never clustered: the tie would break)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return sorted({k.removesuffix(".weight") for k in set(tied) | set(tied.values())})


def check_not_quantized(model: nn.Module) -> None:
    """DKM clusters full-precision weights: a model another method already quantized (bitsandbytes 4/8-bit, ...)
    has none to cluster, and DKM would silently leave its layers alone."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    foreign = [name for name, m in model.named_modules() if type(m).__module__.startswith("bitsandbytes")]
    if foreign or (method is not None and str(getattr(method, "value", method)) != "dkm"):
        kind = "bitsandbytes" if foreign or "bitsandbytes" in str(method) else str(getattr(method, "value", method))
        raise ValueError(
            f"DKM cannot cluster a model whose weights are already quantized by {kind} "
            f"({foreign[0] if foreign else type(quantizer).__name__}); load the base in full precision "
            "(drop load_in_4bit / load_in_8bit) and let DKM quantize it"
        )


def dkm_targets(model: nn.Module, config: DKMConfig, skip: list[str]) -> dict[str, tuple[str, int, int]]:
    """`{module name: (kind, rows, cols)}` of the modules `config` clusters (a shape error names the fix)."""
    targets = {}
    for name, module in model.named_modules():
        if not name or not should_convert_module(name, skip):
            continue
        if type(module) is nn.Linear:
            kind, rows, cols = "linear", module.out_features, module.in_features
        elif type(module) is nn.Embedding and config.quantize_embeddings:
            kind, rows, cols = "embedding", module.num_embeddings, module.embedding_dim
        else:
            continue
        config.check_shape(name, rows, cols)
        targets[name] = (kind, rows, cols)
    return targets


def replace_with_dkm_layers(
    model: nn.Module, config: DKMConfig, skip: list[str], packed: bool | dict[str, str] = False
) -> list[str]:
    """Swap every target Linear/Embedding of `model` (on any device) for a DKM layer; returns their names.

    `packed`: True builds packed inference layers, False trainable ones, or a `checkpoint_layout` (per module).
    A live model's weights are kept (a trainable layer then needs `init_centroids`).
    """
    targets = dkm_targets(model, config, skip)
    for name, (kind, rows, cols) in targets.items():
        module = model.get_submodule(name)
        settings = DKMSettings.from_config(config, kind, rows)
        device, dtype = module.weight.device, module.weight.dtype
        as_packed = packed.get(name) == "packed" if isinstance(packed, dict) else packed
        if not as_packed and config.engine != "auto":
            reason = engines.unsupported(config.engine, dtype, config.cluster_dim, config.shard)
            if reason is not None:
                raise ValueError(f"DKMConfig(engine={config.engine!r}) cannot train {name!r}: it {reason}.")
        if kind == "linear":
            cls = PalettizedLinear if as_packed else DKMLinear
            new = cls(cols, rows, module.bias is not None, settings, device=device, dtype=dtype)
        else:
            cls = PalettizedEmbedding if as_packed else DKMEmbedding
            new = cls(rows, cols, module.padding_idx, settings, device=device, dtype=dtype)
        if not as_packed and device.type != "meta":  # a live model: keep its weights
            new.load_state_dict(module.state_dict(), strict=False)
        model.set_submodule(name, new)
    return list(targets)


def trainable_from_packed(model: nn.Module) -> list[str]:
    """Swap every packed layer of `model` (loaded from a compact DKM checkpoint) for a trainable DKM layer whose table
    is the saved one and whose latent weight is the decoded weight, in place; returns their names.

    The model computes what it did (the hard assignment of the decoded weights onto their own tables is those
    weights); DKM training continues from there, and peft's methods, which adapt `nn.Linear` layers, can wrap its
    layers (a packed layer is none). `save_pretrained` writes a compact checkpoint again."""
    from hf_llmkit.quantization.training_state import guard_training_state

    dtype = getattr(model, "dtype", None) or torch.get_default_dtype()
    # each layer would say that its latent weights restart from the hard assignment: that is the point here
    quiet = logging.getLogger("hf_llmkit.quantization.layers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        swapped = _swap_packed(model, dtype)
    finally:
        quiet.setLevel(level)
    if swapped:
        guard_training_state(model)
    return swapped


def _swap_packed(model: nn.Module, dtype: torch.dtype) -> list[str]:
    from hf_llmkit.quantization.tied import TiedDKMHead

    swapped, replaced = [], {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, PACKED):
            continue
        rows, cols = module.weight_shape
        device = module.weight_packed.device
        if isinstance(module, PalettizedLinear):
            bias = module.bias is not None
            new = DKMLinear(cols, rows, bias, module.settings, device=device, dtype=dtype)
        else:
            new = DKMEmbedding(rows, cols, module.padding_idx, module.settings, device=device, dtype=module.dtype)
        new.load_state_dict(module.state_dict())  # the packed tensors decode into weight + centroids (+ scales)
        model.set_submodule(name, new)
        swapped.append(name)
        replaced[id(module)] = new
    for head in model.modules():  # an LM head tied to a swapped embedding multiplies by the trainable one now
        if isinstance(head, TiedDKMHead) and id(head.embedding) in replaced:
            head.tie_to(replaced[id(head.embedding)])
    return swapped


class DKMInitTables(ConversionOps):
    """Loading op of a DKM layer's weight: passes the weight through and adds its k-means table."""

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], model: nn.Module | None = None, **kwargs) -> dict[str, Any]:
        out = {}
        for key, value in input_dict.items():
            weight = value[0] if isinstance(value, list) else value
            module, _ = get_module_from_name(model, key)
            out[key] = weight
            if isinstance(module, TRAINABLE):
                module.init_centroids(weight)
                out[f"{key.rpartition('.')[0]}.centroids"] = module.centroids
                if module.scales is not None:
                    out[f"{key.rpartition('.')[0]}.scales"] = module.scales
        return out


def verify_loaded(model: nn.Module, pre_quantized: bool) -> None:
    """After loading: packed layers match their config and hold finite tables; trainable layers have tables."""
    for name, module in model.named_modules():
        if isinstance(module, PACKED):
            module.check_packed(name)
        elif isinstance(module, TRAINABLE):
            if pre_quantized:  # loaded from a Trainer checkpoint's training state
                check_table(f"{name}.centroids", module.centroids, module.table_shape)
                if module.scales is not None:
                    check_scales(f"{name}.scales", module.scales, tuple(module.scales.shape))
                module.dkm_initialised = True
                module.start = "loaded"  # a start: its scales are kept in training (layers._Clustered.start)
            elif not module.dkm_initialised:
                module.init_centroids()  # a weight that was not in the checkpoint (freshly initialised)


def initialise_missing_biases(model: nn.Module) -> list[str]:
    """After `from_pretrained`: the bias of each packed Linear that the checkpoint did not hold (a DKM Llama checkpoint
    loaded with `attention_bias=True`, or by `Qwen2ForCausalLM`) initialised as transformers initialises a missing
    `nn.Linear` bias (zeros), instead of left as uninitialised memory; returns their names. A layer none of whose
    tensors came from a checkpoint (not a load) is left alone."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, PalettizedLinear) or module.bias is None or loaded_by_from_pretrained(module.bias):
            continue
        if loaded_by_from_pretrained(module.weight_packed):
            initialise_missing_bias(model, module.bias)
            names.append(f"{name}.bias")
    return names


def check_saveable(model: nn.Module) -> None:
    """Raise a ValueError naming the layer and the fix when a DKM layer's table or block scales (or a latent weight)
    hold NaN or infinity: its hard assignment, and so the packed indices, would be meaningless."""
    for name, module in model.named_modules():
        if isinstance(module, TRAINABLE):
            tensors = {"table": module.centroids, "block scales": module.scales}
            if not isinstance(module.weight, DTensor):
                tensors["latent weight"] = module.weight
        elif isinstance(module, PACKED):
            tensors = {"table": module.weight_lut, "block scales": module.weight_scale}
        else:
            continue
        bad = next((what for what, t in tensors.items() if t is not None and not torch.isfinite(t).all()), None)
        if bad is not None:
            raise ValueError(
                f"Cannot save the DKM model: the {bad} of {name!r} holds NaN or infinity (a diverged step?), so its "
                "indices mean nothing; save a checkpoint from before it (or train with a lower learning rate)"
            )


def dkm_state_dict(model: nn.Module, full_state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The state dict `save_pretrained` writes: packed indices + lookup tables for every DKM layer (and a one-byte
    `stand_in_weight` in place of its dense weight), or the latent weight and centroids of the layers that keep their
    training state, next to their packed export.

    `full_state`: the model's full state dict as a Trainer gathered it on every rank for the save (FSDP2, ZeRO-3:
    each rank holds only a shard of the weights, see `DKMHfQuantizer.exporting_from`); the layers are packed from its
    full weights, on the process that writes. Without it the model's own state dict is used, which must then hold
    full tensors: a sharded one (`DTensor`) is refused before any work, as only one rank writes and a gather there
    would wait for the others forever.
    """
    state = dict(full_state) if full_state is not None else model.state_dict()
    sharded = next((key for key, value in state.items() if isinstance(value, DTensor)), None)
    if sharded is not None:
        raise ValueError(
            f"Cannot save the DKM model: {sharded!r} is a shard of an FSDP2 (DTensor) parameter and DKM packs its "
            "indices from full weights. Save with hf_llmkit's LLMKitTrainer.save_model (it packs the full state dict "
            "every rank gathers), or pass that full state dict to save_pretrained inside "
            "model.hf_quantizer.exporting_from(full_state_dict)."
        )
    compact = False  # a stand-in weight was written
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, PACKED):
            state[prefix + "weight"], compact = stand_in_weight(), True
        if isinstance(module, TRAINABLE):
            weight = state.get(prefix + "weight", module.weight)
            centroids = state.get(prefix + "centroids", module.centroids)
            scales = state.get(prefix + "scales", module.scales)
            if not module.keep_training_state:
                for name_ in (*TRAINING_NAMES, SCALE_NAMES["train"]):
                    state.pop(prefix + name_, None)
                state[prefix + "weight"], compact = stand_in_weight(), True
            else:
                state.update(steps.step_state(module, prefix))
            state.update({prefix + k: v for k, v in module.export(weight, centroids, scales).items()})
    if compact:
        state[IMPORT_MARKER] = stand_in_weight()  # a compact layer was written: a dense load must fail, saying why
    return state
