"""`DKMHfQuantizer`: the transformers 5.x `HfQuantizer` of the "dkm" method.

On-the-fly (`from_pretrained(path, quantization_config=DKMConfig(...))`): target `nn.Linear` (and optionally
`nn.Embedding`) modules are swapped for DKM layers while the model is on the meta device; as each of their
weights is loaded, `DKMInitTables` (the quantizer's `ConversionOps`) runs the k-means that initialises its
table. Saving writes the packed indices and the lookup tables (`get_state_dict_and_metadata`) with the config in
`config.json`; reloading that folder builds packed inference layers whose buffers carry the checkpoint's own
names, so transformers' loader fills them directly, and the quantizer then checks them against the config.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name, should_convert_module

from hf_llmkit.quantization.config import DKMConfig
from hf_llmkit.quantization.layers import (
    DKMEmbedding,
    DKMLinear,
    DKMSettings,
    PalettizedEmbedding,
    PalettizedLinear,
)

TRAINABLE = (DKMLinear, DKMEmbedding)
PACKED = (PalettizedLinear, PalettizedEmbedding)


def _tied_modules(model: nn.Module) -> list[str]:
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return sorted({k.removesuffix(".weight") for k in set(tied) | set(tied.values())})


def replace_with_dkm_layers(model: nn.Module, config: DKMConfig, skip: list[str], packed: bool) -> list[str]:
    """Swap every target Linear/Embedding of `model` (on any device) for a DKM layer; returns their names."""
    converted = []
    for name, module in list(model.named_modules()):
        if not name or not should_convert_module(name, skip):
            continue
        if type(module) is nn.Linear:
            kind, rows, cols = "linear", module.out_features, module.in_features
        elif type(module) is nn.Embedding and config.quantize_embeddings:
            kind, rows, cols = "embedding", module.num_embeddings, module.embedding_dim
        else:
            continue
        config.check_shape(name, rows, cols)
        settings = DKMSettings.from_config(config, kind, rows)
        device, dtype = module.weight.device, module.weight.dtype
        if kind == "linear":
            cls = PalettizedLinear if packed else DKMLinear
            new = cls(cols, rows, module.bias is not None, settings, device=device, dtype=dtype)
        else:
            cls = PalettizedEmbedding if packed else DKMEmbedding
            new = cls(rows, cols, module.padding_idx, settings, device=device, dtype=dtype)
        if not packed and device.type != "meta":  # a live model: keep its weights
            new.load_state_dict(module.state_dict(), strict=False)
        model.set_submodule(name, new)
        converted.append(name)
    return converted


class DKMInitTables(ConversionOps):
    """Loading op of a DKM layer's weight: passes the weight through and adds its k-means table."""

    def __init__(self, hf_quantizer: DKMHfQuantizer):
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
        return out


class DKMHfQuantizer(HfQuantizer):
    """DKM / eDKM train-time weight clustering (quantization-aware training; trainable with or without PEFT)."""

    requires_calibration = False
    quantization_config: DKMConfig

    def __init__(self, quantization_config: DKMConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.modules_to_not_convert: list[str] = []

    @property
    def quantized_element_size(self) -> float:
        return self.quantization_config.bits / 8

    def _process_model_before_weight_loading(self, model, keep_in_fp32_modules=None, **kwargs):
        skip = list(self.quantization_config.modules_to_not_convert) + _tied_modules(model)
        skip += list(getattr(model, "_keep_in_fp32_modules", None) or [])
        self.modules_to_not_convert = sorted(set(skip))
        replace_with_dkm_layers(
            model, self.quantization_config, self.modules_to_not_convert, packed=self.pre_quantized
        )
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module, tensor_name = get_module_from_name(model, param_name)
        if self.pre_quantized:
            # Lets packed tensors of any shape reach `_process_model_after_weight_loading`, which names the problem.
            return isinstance(module, PACKED) and tensor_name in ("weight_packed", "weight_lut")
        return isinstance(module, TRAINABLE) and tensor_name == "weight"

    def get_quantize_ops(self) -> ConversionOps:
        return DKMInitTables(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        for name, module in model.named_modules():
            if isinstance(module, PACKED):
                module.check_packed(name)
            elif isinstance(module, TRAINABLE) and not module.dkm_initialised:
                module.init_centroids()  # a weight that was not in the checkpoint (freshly initialised)
        return model

    def get_state_dict_and_metadata(self, model):
        """The checkpoint of a DKM model: packed indices + lookup tables instead of latent weights + centroids."""
        state_dict = model.state_dict()
        for name, module in model.named_modules():
            if isinstance(module, TRAINABLE):
                prefix = f"{name}." if name else ""
                del state_dict[prefix + "weight"], state_dict[prefix + "centroids"]
                state_dict[prefix + "weight_packed"], state_dict[prefix + "weight_lut"] = module.export()
        return state_dict, {}

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return True


def quantize_model(model, config: DKMConfig):
    """Apply DKM to a model that is already built (e.g. from a config): what `from_pretrained` does on load.

    Returns the same model with DKM layers initialised by k-means, `hf_quantizer` attached and the config in
    `model.config.quantization_config`, ready for the Trainer and `save_pretrained`.
    """
    quantizer = DKMHfQuantizer(config, pre_quantized=False)
    quantizer.preprocess_model(model)
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    return model
