"""The P-tuning v2 tuner layer: wraps a `transformers` attention module and hands it the prefix of its layer.

The wrapper does not touch the attention weights; it passes the active adapters' prefixes (concatenated) as a
keyword argument that flows through the attention module's `**kwargs` into the registered prefix attention
function (see `attention.py`). Because the prefix is produced inside the decoder layer's forward, activation
checkpointing recomputes it with the rest of the layer.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from hf_llmkit.parallel.attention import stack_of
from hf_llmkit.tuners.base import UnmergeableLayer
from hf_llmkit.tuners.ptuning_v2.attention import PREFIX_KWARG, PrefixAttention
from hf_llmkit.tuners.ptuning_v2.config import PTuningV2Config
from hf_llmkit.tuners.ptuning_v2.prefix import PlainPrefix, ProjectedPrefix

MERGE_ERROR = (
    "P-tuning v2 prepends trainable keys/values to attention; they cannot be folded into any base weight, so it "
    "cannot merge. Use `model.unload()` to get the base model back, or keep the adapter attached."
)


def attention_geometry(module: nn.Module) -> tuple[int, int, int]:
    """(key/value heads, head dim, hidden size) of a transformers attention module, read from its config."""
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if config is None or heads is None or not hasattr(module, "layer_idx"):
        raise TypeError(
            f"P-tuning v2 wraps transformers attention modules (with .config and .layer_idx), got "
            f"{type(module).__name__}; set target_modules to the model's attention modules (e.g. 'self_attn')"
        )
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim, config.hidden_size


class PTuningV2Layer(BaseTunerLayer):
    adapter_layer_names = ("ptuning_v2_prefix",)
    other_param_names = ()

    def __init__(self, base_layer: nn.Module, **kwargs: Any) -> None:
        self.base_layer = base_layer
        self.ptuning_v2_prefix = nn.ModuleDict({})
        self._disable_adapters = False
        self.merged_adapters = []
        self.kv_heads, self.head_dim, self.hidden_size = attention_geometry(self.get_base_layer())
        self.in_features = self.out_features = self.hidden_size  # attention maps hidden states to hidden states

    def update_layer(self, adapter_name: str, config: PTuningV2Config, *, key: str = "") -> None:
        geometry = dict(kv_heads=self.kv_heads, num_virtual_tokens=config.num_virtual_tokens, head_dim=self.head_dim)
        if config.prefix_projection and not config.inference_mode:
            hidden = config.encoder_hidden_size or self.hidden_size
            module = ProjectedPrefix(**geometry, token_dim=self.hidden_size, hidden=hidden, init_std=config.init_std)
        else:
            module = PlainPrefix(**geometry, init_std=config.init_std)
        device = next((p.device for p in self.get_base_layer().parameters() if p.device.type != "meta"), None)
        if device is not None and all(p.device.type != "meta" for p in module.parameters()):
            module = module.to(device)  # adapters created on meta (low_cpu_mem_usage) are materialised by loading
        self.ptuning_v2_prefix[adapter_name] = module
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def fold(self, adapter_name: str) -> None:
        """Replace the adapter's MLP reparameterisation by the plain prefix it currently produces."""
        module = self.ptuning_v2_prefix[adapter_name]
        if isinstance(module, ProjectedPrefix):
            plain = module.fold()
            plain.requires_grad_(module.embedding.requires_grad)
            self.ptuning_v2_prefix[adapter_name] = plain


class PTuningV2Attention(UnmergeableLayer, nn.Module, PTuningV2Layer):
    """A transformers attention module whose keys/values get the active adapters' prefixes prepended."""

    merge_error = MERGE_ERROR

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: PTuningV2Config, *, key: str = "") -> None:
        super().__init__()
        PTuningV2Layer.__init__(self, base_layer)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, key=key)

    def current_prefix(self) -> torch.Tensor | None:
        """The active adapters' prefixes, concatenated along the token axis: `[2, KVH, P, D]`, or None."""
        if self.disable_adapters:
            return None
        parts = [self.ptuning_v2_prefix[a]() for a in self.active_adapters if a in self.ptuning_v2_prefix]
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        prefix = self.current_prefix()
        if prefix is not None:
            stack = stack_of(self.get_base_layer().config)
            if stack.find(PrefixAttention.kind) is None:
                raise ValueError(
                    f"the model's attention implementation is {stack.name!r}, so the P-tuning v2 prefixes would "
                    "be ignored; change implementations before get_peft_model (or unload(), switch, and re-apply)"
                )
            kwargs[PREFIX_KWARG] = prefix
        return self.base_layer(*args, **kwargs)

    def __repr__(self) -> str:
        return "ptuning_v2." + super().__repr__()
