"""`WrappingTuner`: the peft plumbing shared by tuners that wrap whole modules and cannot merge (P-tuning v1, v2).

Such a tuner wraps each target in one `wrapper_cls` (a second adapter updates the existing wrapper), keeps its
per-adapter state in a `ModuleDict` attribute whose entries are whole modules (so state-dict keys carry the adapter
name below that attribute, deeper than peft's default expects), and refuses every merge with `merge_error`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer, _remove_adapter_name_from_state_dict_key
from torch import nn

from hf_llmkit.tuners.matching import check_targets_exist


class WrappingTuner(BaseTuner):
    wrapper_cls: ClassVar[type[nn.Module]]  # the tuner layer class wrapping a target: wrapper_cls(target, name, cfg)
    adapter_dict_name: ClassVar[str]  # the ModuleDict attribute of the layer that holds each adapter's module
    merge_error: ClassVar[str]

    def _prepare_model(self, peft_config: Any, model: nn.Module) -> None:
        check_targets_exist(model, peft_config.target_modules, type(peft_config).__name__)

    def _create_and_replace(
        self,
        peft_config: Any,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        **optional_kwargs: Any,
    ) -> None:
        if isinstance(target, self.tuner_layer_cls):
            target.update_layer(adapter_name, peft_config)
            return
        if isinstance(target, BaseTunerLayer):
            raise ValueError(
                f"{current_key} is already wrapped by another PEFT method; apply {type(peft_config).__name__} first"
            )
        new_module = self.wrapper_cls(target, adapter_name, peft_config)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

    def _check_merge_allowed(self) -> None:
        raise ValueError(self.merge_error)

    def merge_adapter(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(self.merge_error)

    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        # `<dict>.<adapter>.head.0.weight` -> `<dict>.head.0.weight`; peft's default only strips `<dict>.<adapter>`
        # followed by a single suffix.
        marker = f".{cls.adapter_dict_name}.{adapter_name}."
        if marker in key:
            return key.replace(marker, f".{cls.adapter_dict_name}.", 1)
        return _remove_adapter_name_from_state_dict_key(key, adapter_name)
