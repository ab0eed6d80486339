"""The BitFit layer: a trainable bias delta added to a module's output, foldable into the module's bias."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import nn
from transformers import Conv1D

from hf_llmkit.tuners.features import linear_features


def bias_shape(module: nn.Module, *, add_missing: bool) -> tuple[int, ...] | None:
    """Shape of the bias BitFit trains on `module`, or None when the module is not eligible.

    Eligible: Linear (bitsandbytes layers included), GPT-2's Conv1D and LayerNorm, with a bias, or a bias-less
    Linear when `add_missing`. Shapes come from module attributes (never `bias.shape`), so they stay right
    under DeepSpeed ZeRO-3, where partitioned parameters have an empty local shape.
    """
    has_bias = getattr(module, "bias", None) is not None
    if isinstance(module, nn.Linear):
        return (module.out_features,) if has_bias or add_missing else None
    if isinstance(module, Conv1D):
        return (module.nf,) if has_bias else None
    if isinstance(module, nn.LayerNorm):
        return tuple(module.normalized_shape) if has_bias else None
    return None


def in_out_features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a module `bias_shape` accepts (a LayerNorm maps its normalized shape onto itself)."""
    if isinstance(module, nn.LayerNorm):
        size = math.prod(module.normalized_shape)
        return size, size
    return linear_features(module)


class BitFitLayer(nn.Module, BaseTunerLayer):
    """A module whose output gets `+ bitfit_bias[adapter]` for each active adapter."""

    adapter_layer_names = ("bitfit_bias",)
    other_param_names = ()

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: Any, *, key: str = "") -> None:
        super().__init__()
        self.base_layer = base_layer
        self.bitfit_bias = nn.ParameterDict()
        self._disable_adapters = False
        self.merged_adapters = []
        self._created_base_bias = False  # merge gave a bias-less layer a bias; unmerge removes it again
        shape = bias_shape(base_layer, add_missing=config.add_missing_biases)
        if shape is None:
            where = f" at {key}" if key else ""
            raise TypeError(f"BitFit cannot train a bias on {type(base_layer).__name__}{where}.")
        self.bias_shape = shape
        self.in_features, self.out_features = in_out_features(base_layer)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config)

    def update_layer(self, adapter_name: str, config: Any, *, key: str = "") -> None:
        device, dtype = self._device_dtype()
        delta = torch.zeros(self.bias_shape, device=device, dtype=dtype)
        if not config.init_weights:
            delta.normal_(std=0.1)
        self.bitfit_bias[adapter_name] = nn.Parameter(delta)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def _device_dtype(self) -> tuple[torch.device, torch.dtype]:
        base = self.get_base_layer()
        bias = getattr(base, "bias", None)
        if bias is not None:
            return bias.device, bias.dtype
        weight = base.weight
        dtype = getattr(base, "compute_dtype", None) or (weight.dtype if weight.dtype.is_floating_point else None)
        return weight.device, dtype or torch.float32

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add the active adapters' deltas to the base bias (creating it on a bias-less Linear)."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        base = self.get_base_layer()
        for name in adapter_names:
            if name not in self.bitfit_bias:
                continue
            delta = self.bitfit_bias[name].detach()
            if base.bias is None:  # in the layer's dtype: the delta may be an fp32 adapter of an fp16 / bf16 base
                device, dtype = self._device_dtype()
                base.bias = nn.Parameter(torch.zeros(delta.shape, device=device, dtype=dtype), requires_grad=False)
                self._created_base_bias = True
            merged = base.bias.data + delta.to(base.bias.dtype)
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError(f"NaNs or infs in the merged bias; adapter {name!r} seems to be broken.")
            base.bias.data = merged
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        base = self.get_base_layer()
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if name in self.bitfit_bias:
                base.bias.data = base.bias.data - self.bitfit_bias[name].detach().to(base.bias.dtype)
        if self._created_base_bias:
            base.bias = None
            self._created_base_bias = False

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters and self.merged:
            self.unmerge()
        result = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters or self.merged:
            return result
        for name in self.active_adapters:
            if name in self.bitfit_bias:
                result = result + self.bitfit_bias[name].to(result.dtype)
        return result

    def __repr__(self) -> str:
        return "bitfit." + super().__repr__()
