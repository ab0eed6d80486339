"""The bottleneck adapter layer: wraps one module and adds `s * f(z W_down) W_up` to its output.

Sequential placements (Houlsby, Pfeiffer) take `z` = the module's output, so the wrapped module computes
`h + s * f(h W_down) W_up`; the parallel placement takes `z` = the module's input (He et al. 2022).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers.activations import ACT2FN

from hf_llmkit.tuners.base import UnmergeableLayer
from hf_llmkit.tuners.features import linear_features

MERGE_ERROR = (
    "Bottleneck adapters cannot be merged into the base weights: f(z W_down) W_up has an activation between the "
    "projections, so it is no linear map of the base weights. Keep the PeftModel with the adapter for inference, "
    "or call `unload()` to get the base model back without the adapter."
)


def linear_in_out(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a module: itself if Linear-like, else its first and last Linear-like descendant.

    Uses module attributes, never `weight.shape`, so it is right under DeepSpeed ZeRO-3 partitioning. A
    mixture-of-experts block (an `experts` child of fused weights: `MoELayer`, Mixtral / Qwen2-MoE sparse blocks)
    maps hidden -> hidden; its width is the experts' hidden size.
    """
    experts = getattr(module, "experts", None)
    if isinstance(experts, nn.Module):
        hidden = getattr(experts, "hidden_dim", None) or getattr(experts, "hidden_size", None)
        if isinstance(hidden, int):
            return hidden, hidden
    leaves = [m for m in module.modules() if hasattr(m, "weight") and not list(m.children())]
    leaves = [features for m in leaves if (features := linear_features(m)) is not None]
    if not leaves:
        raise TypeError(
            f"Cannot adapt {type(module).__name__}: it contains no Linear layer to infer its width from; "
            "target a Linear layer or a block (e.g. an MLP) built from them."
        )
    return leaves[0][0], leaves[-1][1]


def _compute_device_dtype(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and floating dtype the adapter should use next to `module` (quantized weights are skipped)."""
    device, dtype = torch.device("cpu"), torch.float32
    for m in module.modules():
        compute_dtype = getattr(m, "compute_dtype", None)  # bitsandbytes 4-bit layers
        for p in m.parameters(recurse=False):
            device = p.device
            if compute_dtype is not None:
                return device, compute_dtype
            if p.dtype.is_floating_point:
                return device, p.dtype
    return device, dtype


class BottleneckLayer(UnmergeableLayer, nn.Module, BaseTunerLayer):
    """A module wrapped with one bottleneck adapter per adapter name."""

    merge_error = MERGE_ERROR

    adapter_layer_names = ("bottleneck_down", "bottleneck_up")
    other_param_names = ("bottleneck_act", "bottleneck_dropout", "bottleneck_scaling", "bottleneck_placement")

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: Any, *, key: str = "") -> None:
        super().__init__()
        self.base_layer = base_layer
        self.bottleneck_down = nn.ModuleDict()
        self.bottleneck_up = nn.ModuleDict()
        self.bottleneck_act = nn.ModuleDict()
        self.bottleneck_dropout = nn.ModuleDict()
        self.bottleneck_scaling: dict[str, float] = {}
        self.bottleneck_placement: dict[str, str] = {}
        self._disable_adapters = False
        self.merged_adapters = []
        self.in_features, self.out_features = linear_in_out(self.get_base_layer())
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, key=key)
        self.train(base_layer.training)  # a model in eval mode gets adapters in eval mode (no dropout)

    def update_layer(self, adapter_name: str, config: Any, *, key: str = "") -> None:
        parallel = config.placement == "parallel"
        source_features = self.in_features if parallel else self.out_features
        size = config.bottleneck_for(self.out_features)
        if size > self.out_features:
            raise ValueError(
                f"Bottleneck of {size} at {key or type(self.base_layer).__name__} is larger than its hidden size "
                f"{self.out_features}; use bottleneck_size <= {self.out_features} or a reduction_factor >= 1."
            )
        device, dtype = _compute_device_dtype(self.get_base_layer())
        self.bottleneck_down[adapter_name] = nn.Linear(source_features, size, device=device, dtype=dtype)
        self.bottleneck_up[adapter_name] = nn.Linear(size, self.out_features, device=device, dtype=dtype)
        self.bottleneck_act[adapter_name] = ACT2FN[config.non_linearity]
        self.bottleneck_dropout[adapter_name] = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.bottleneck_dropout[adapter_name].train(self.training)
        self.bottleneck_scaling[adapter_name] = float(config.scaling)
        self.bottleneck_placement[adapter_name] = config.placement
        self.reset_parameters(adapter_name, config.init_weights)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def reset_parameters(self, adapter_name: str, init_weights: bool) -> None:
        down, up = self.bottleneck_down[adapter_name], self.bottleneck_up[adapter_name]
        nn.init.kaiming_uniform_(down.weight, a=math.sqrt(5))
        nn.init.zeros_(down.bias)
        if init_weights:  # zero up projection: the adapter starts as the identity
            nn.init.zeros_(up.weight)
            nn.init.zeros_(up.bias)
        else:  # non-identity init so tests can see the adapter act
            nn.init.normal_(up.weight, std=0.5 / math.sqrt(up.in_features))
            nn.init.normal_(up.bias, std=0.02)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.base_layer(*args, **kwargs)
        if self.disable_adapters:
            return result
        if not isinstance(result, torch.Tensor):
            raise TypeError(
                f"Bottleneck adapters need a module returning a tensor, {type(self.base_layer).__name__} returned "
                f"{type(result).__name__}; target its output projection instead (e.g. 'self_attn.o_proj')."
            )
        module_input = args[0] if args else next(iter(kwargs.values()))
        for name in self.active_adapters:
            if name not in self.bottleneck_down:
                continue
            down = self.bottleneck_down[name]
            source = module_input if self.bottleneck_placement[name] == "parallel" else result
            if source.dtype != down.weight.dtype:
                source = source.to(down.weight.dtype)
            z = self.bottleneck_dropout[name](source)  # [..., in]
            delta = self.bottleneck_up[name](self.bottleneck_act[name](down(z)))  # [..., out]
            # one fused kernel for `result + s * delta` (no separate multiply)
            result = torch.add(result, delta.to(result.dtype), alpha=self.bottleneck_scaling[name])
        return result

    def __repr__(self) -> str:
        return "bottleneck." + super().__repr__()
