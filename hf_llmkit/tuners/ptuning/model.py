"""P-tuning v1 as a layer-injecting peft tuner: wraps the model's input embedding with `PTuningEmbedding`.

peft's own P-tuning is a prompt-learning method (hard-coded in `PeftModel`, saves only the encoder's output); this
one is a `BaseTuner`, so the encoder's weights are the saved state, several adapters coexist, and `unload()`,
`disable_adapter()` and `set_adapter()` work as for LoRA.
"""

from __future__ import annotations

from typing import Any

from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer, _remove_adapter_name_from_state_dict_key
from torch import nn

from hf_llmkit.tuners.matching import check_targets_exist
from hf_llmkit.tuners.ptuning.config import PTuningConfig
from hf_llmkit.tuners.ptuning.layer import MERGE_ERROR, PTuningEmbedding, PTuningLayer


class PTuningModel(BaseTuner):
    """Wraps the input embedding of `model` so virtual tokens are embedded by a trainable prompt encoder.

    Example:
        ```py
        >>> import hf_llmkit
        >>> from peft import get_peft_model
        >>> config = hf_llmkit.PTuningConfig(num_virtual_tokens=4, template="[P0][P1] {text} [P2][P3]")
        >>> template = hf_llmkit.PTuningTemplate(tokenizer, config)  # adds [P0]..[P3] to the tokenizer
        >>> model = get_peft_model(model, config)
        >>> batch = tokenizer(template.format(text="Paris is the capital of"), return_tensors="pt")
        ```
    """

    prefix: str = "ptuning_"
    tuner_layer_cls = PTuningLayer
    target_module_mapping: dict[str, list[str]] = {}

    def _prepare_adapter_config(self, peft_config: PTuningConfig, model_config: dict) -> PTuningConfig:
        if peft_config.target_modules is None:
            getter = getattr(self.model, "get_input_embeddings", None)
            embeddings = getter() if callable(getter) else None
            names = [name for name, module in self.model.named_modules() if module is embeddings and name]
            if not names:
                raise ValueError("could not find the model's input embedding module; set target_modules explicitly")
            peft_config.target_modules = {names[0]}
        return peft_config

    def _prepare_model(self, peft_config: PTuningConfig, model: nn.Module) -> None:
        check_targets_exist(model, peft_config.target_modules, "PTuningConfig")

    def _create_and_replace(
        self,
        peft_config: PTuningConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        **optional_kwargs: Any,
    ) -> None:
        if isinstance(target, PTuningLayer):
            target.update_layer(adapter_name, peft_config)
            return
        if isinstance(target, BaseTunerLayer):
            raise ValueError(f"{current_key} is already wrapped by another PEFT method; P-tuning must wrap it first")
        new_module = PTuningEmbedding(target, adapter_name, peft_config)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

    def _check_merge_allowed(self) -> None:
        raise ValueError(MERGE_ERROR)

    def merge_adapter(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(MERGE_ERROR)

    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        # Encoder weights sit below the adapter name (`ptuning_encoder.<adapter>.head.0.weight`), deeper than
        # peft's default (`<attr>.<adapter>.weight`) expects.
        marker = f".ptuning_encoder.{adapter_name}."
        if marker in key:
            return key.replace(marker, ".ptuning_encoder.", 1)
        return _remove_adapter_name_from_state_dict_key(key, adapter_name)
