"""P-tuning v2 as a layer-injecting peft tuner: prefix keys/values per attention layer via the attention interface.

Injection wraps each attention module in `PTuningV2Attention` and adds the prefix layer to the model's attention stack
(`hf_llmkit.parallel.attention`), switching, say, `"sdpa"` to `"ptuning_v2_sdpa"`, which delegates to sdpa (or to
`"llmkit_ulysses_ptuning_v2_sdpa@..."` under sequence parallelism); `disable_adapter()` and `unload()` take the layer
out again. Saving writes the folded prefixes (plus, by default, the MLP reparameterisation so training can resume).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_llmkit.parallel.attention import add_attention_layer, remove_attention_layer
from hf_llmkit.tuners.base import LLMKitTuner
from hf_llmkit.tuners.matching import unwrapped, visible_modules
from hf_llmkit.tuners.ptuning_v2.attention import PrefixAttention
from hf_llmkit.tuners.ptuning_v2.config import PTuningV2Config
from hf_llmkit.tuners.ptuning_v2.layer import PTuningV2Attention, PTuningV2Layer
from hf_llmkit.tuners.ptuning_v2.prefix import PlainPrefix, ProjectedPrefix

_PROJECTION_KEYS = ("embedding", "down.weight", "down.bias", "up.weight", "up.bias")


def attention_module_names(model: nn.Module) -> list[str]:
    """Names of the transformers attention layers of `model` (`*Attention` modules that know their `layer_idx`)."""
    names = []
    for name, module in visible_modules(model):  # an attention module already wrapped (a second adapter): the wrapper
        base = unwrapped(module)
        if type(base).__name__.endswith("Attention") and hasattr(base, "layer_idx") and hasattr(base, "config"):
            names.append(name)
    return names


class PTuningV2Model(LLMKitTuner):
    """Gives every targeted attention layer trainable prefix keys/values (deep prompt tuning).

    Example:
        ```py
        >>> import hf_llmkit
        >>> from peft import get_peft_model
        >>> model = get_peft_model(model, hf_llmkit.PTuningV2Config(num_virtual_tokens=16, prefix_projection=True))
        >>> model.base_model.fold_prefix_projection()  # optional: drop the MLP for inference
        ```
    """

    prefix: str = "ptuning_v2_"
    tuner_layer_cls = PTuningV2Attention

    def _prepare_adapter_config(self, peft_config: PTuningV2Config, model_config: dict) -> PTuningV2Config:
        if peft_config.target_modules is None:
            names = attention_module_names(self.model)
            if not names:
                raise ValueError(
                    f"P-tuning v2 prepends keys/values inside attention, and {type(self.model).__name__} has no "
                    "transformers attention module (a *Attention module with layer_idx); use it with a transformers "
                    "model, or set target_modules to the names of its attention modules"
                )
            peft_config.target_modules = set(names)
        return peft_config

    # --- the attention implementation switch -------------------------------------------------------------------

    def _post_injection_hook(self, model: nn.Module, config: PTuningV2Config, adapter_name: str) -> None:
        self._use_prefix_attention(True)

    def _use_prefix_attention(self, enabled: bool) -> None:
        if enabled:
            add_attention_layer(self.model, PrefixAttention())
        else:
            remove_attention_layer(self.model, PrefixAttention.kind)

    def _enable_adapter_layers(self, enabled: bool = True) -> None:
        super()._enable_adapter_layers(enabled)
        self._use_prefix_attention(enabled)

    def _unload_and_optionally_merge(self, merge: bool = True, *args: Any, **kwargs: Any) -> nn.Module:
        if merge:
            self._check_merge_allowed()  # raises: prefixes cannot be folded into weights
        self._use_prefix_attention(False)
        return super()._unload_and_optionally_merge(False, *args, **kwargs)

    def fold_prefix_projection(self, adapter_name: str | None = None) -> None:
        """Replace the MLP reparameterisation of `adapter_name` (default: all adapters) by plain prefixes."""
        for module in self.model.modules():
            if isinstance(module, PTuningV2Layer):
                for name in [adapter_name] if adapter_name else list(module.ptuning_v2_prefix):
                    if name in module.ptuning_v2_prefix:
                        module.fold(name)

    # --- saving and loading ------------------------------------------------------------------------------------

    @classmethod
    def _get_adapter_state_dict(
        cls,
        model: nn.Module,
        config: PTuningV2Config,
        adapter_name: str,
        state_dict: dict[str, torch.Tensor],
        unwanted_adapter_names: list[str],
    ) -> dict[str, torch.Tensor]:
        out = super()._get_adapter_state_dict(model, config, adapter_name, state_dict, unwanted_adapter_names)
        for name, module in model.named_modules():
            if not isinstance(module, PTuningV2Layer) or adapter_name not in module.ptuning_v2_prefix:
                continue
            if not isinstance(module.ptuning_v2_prefix[adapter_name], ProjectedPrefix):
                continue
            # Fold from the given tensors, not the live module: under ZeRO-3 only the passed dict is gathered.
            base = f"{name.removeprefix('_fsdp_wrapped_module.')}.ptuning_v2_prefix.{adapter_name}."
            tensors = {k: out[base + k] for k in _PROJECTION_KEYS}
            out[base + "prefix"] = ProjectedPrefix.fold_state(tensors, module.kv_heads, module.head_dim)
            if not config.save_projection:
                for k in _PROJECTION_KEYS:
                    del out[base + k]
        return out

    @classmethod
    def _remap_adapter_state_dict_for_load(
        cls,
        model: nn.Module,
        config: PTuningV2Config,
        adapter_name: str,
        state_dict: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        state_dict = dict(state_dict)
        for name, module in model.named_modules():
            if not isinstance(module, PTuningV2Layer) or adapter_name not in module.ptuning_v2_prefix:
                continue
            bases = [f"{name}.ptuning_v2_prefix.", f"base_model.model.{name}.ptuning_v2_prefix."]
            has_projection = any(b + "embedding" in state_dict for b in bases)
            if isinstance(module.ptuning_v2_prefix[adapter_name], ProjectedPrefix) and not has_projection:
                # Saved with save_projection=False: continue from the folded prefixes.
                module.fold(adapter_name)
            drop = ("prefix",) if isinstance(module.ptuning_v2_prefix[adapter_name], ProjectedPrefix) else ()
            if isinstance(module.ptuning_v2_prefix[adapter_name], PlainPrefix):
                drop = _PROJECTION_KEYS  # inference form: only the folded prefixes are used
            for b in bases:
                for k in drop:
                    state_dict.pop(b + k, None)
        return super()._remap_adapter_state_dict_for_load(model, config, adapter_name, state_dict)
