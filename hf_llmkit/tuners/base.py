"""`LLMKitTuner`: the peft `BaseTuner` plumbing every hf_llmkit method shares (bottleneck, BitFit, P-tuning v1/v2).

Each method names its layer class (`tuner_layer_cls`, built as `cls(target, adapter_name, config, key=name)`); this
base class checks the targets before injection (difflib hints), wraps each target once (a second adapter updates the
existing layer), refuses another method's layer, puts whole blocks back on `unload()`, and gives whole-module adapter
state the right checkpoint keys. Methods that cannot merge set `merge_error` and every merge raises it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from torch import nn

from hf_llmkit.tuners.matching import check_targets_exist


class LLMKitTuner(BaseTuner):
    target_module_mapping: ClassVar[dict] = {}  # defaults are computed from the model in _prepare_adapter_config
    merge_error: ClassVar[str | None] = None  # set by methods whose adapters cannot be folded into base weights

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
            target.update_layer(adapter_name, peft_config, key=current_key)
            return
        if isinstance(target, BaseTunerLayer):
            raise ValueError(
                f"{current_key} is already wrapped by another PEFT method; apply {type(peft_config).__name__} first"
            )
        new_module = self.tuner_layer_cls(target, adapter_name, peft_config, key=current_key)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)  # an added, inactive adapter is not trainable
        self._replace_module(parent, target_name, new_module, target)

    def _check_merge_allowed(self) -> None:
        if self.merge_error is not None:
            raise ValueError(self.merge_error)
        super()._check_merge_allowed()

    def _replace_module(self, parent: nn.Module, child_name: str, new_module: nn.Module, child: nn.Module) -> None:
        if not hasattr(new_module, "base_layer") and not hasattr(child.get_base_layer(), "weight"):
            # Unloading a wrapped block (an MLP, an attention module): put it back as is; peft's version would copy
            # a `.weight` that a block does not have.
            setattr(parent, child_name, new_module)
            return
        super()._replace_module(parent, child_name, new_module, child)

    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        # `<attr>.<adapter>.head.0.weight` -> `<attr>.head.0.weight` for adapter state held as whole modules (a
        # ModuleDict of encoders); peft's default only strips `<attr>.<adapter>` followed by a single suffix.
        for attr in cls.tuner_layer_cls.adapter_layer_names:
            marker = f".{attr}.{adapter_name}."
            if marker in key:
                return key.replace(marker, f".{attr}.", 1)
        return super()._remove_adapter_name_from_key(key, adapter_name)
