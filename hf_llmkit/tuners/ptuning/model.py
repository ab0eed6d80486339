"""P-tuning v1 as a layer-injecting peft tuner: wraps the model's input embedding with `PTuningEmbedding`.

peft's own P-tuning is a prompt-learning method (hard-coded in `PeftModel`, saves only the encoder's output); this
one is a `BaseTuner`, so the encoder's weights are the saved state, several adapters coexist, and `unload()`,
`disable_adapter()` and `set_adapter()` work as for LoRA.
"""

from __future__ import annotations

from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn

from hf_llmkit.tuners.base import LLMKitTuner
from hf_llmkit.tuners.matching import visible_modules
from hf_llmkit.tuners.ptuning.config import PTuningConfig
from hf_llmkit.tuners.ptuning.layer import PTuningEmbedding


class PTuningModel(LLMKitTuner):
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
    tuner_layer_cls = PTuningEmbedding
    adapts_packed_layers = True  # it wraps the input embedding only, a packed one included

    def _check_tied_modules(self, model: nn.Module, peft_config: PTuningConfig) -> None:
        # The wrapper never changes the embedding weight, so an output layer tied to it stays tied: peft's warning
        # about untied adapters applies only to embeddings in modules_to_save.
        if peft_config.modules_to_save:
            super()._check_tied_modules(model, peft_config)

    def _prepare_adapter_config(self, peft_config: PTuningConfig, model_config: dict) -> PTuningConfig:
        if peft_config.target_modules is None:
            getter = getattr(self.model, "get_input_embeddings", None)
            embeddings = getter() if callable(getter) else None
            names = [name for name, module in visible_modules(self.model) if module is embeddings and name]
            if not names:
                raise ValueError(
                    f"P-tuning v1 embeds virtual token ids, and {type(self.model).__name__} has no input embedding "
                    "(get_input_embeddings()); use it with a model that takes token ids, or set target_modules to "
                    "its nn.Embedding"
                )
            peft_config.target_modules = {names[0]}
        else:
            # Store full module paths: peft saves the whole base embedding matrix when target_modules literally
            # names `embed_tokens`, and the adapter must hold only the encoder.
            matched = {
                name
                for name, _ in visible_modules(self.model)
                if name and check_target_module_exists(peft_config, name)
            }
            if matched:
                peft_config.target_modules = matched
        saved = [
            (entry, name)
            for entry in peft_config.modules_to_save or []
            for name in sorted(peft_config.target_modules)
            if name == entry or name.endswith("." + entry)
        ]
        if saved:
            entry, name = saved[0]
            if peft_config.modules_to_tie and entry == name:  # put there by ensure_weight_tying (LLMKitTuner)
                tied = sorted(peft_config.modules_to_tie)
                raise ValueError(
                    f"P-tuning v1 wraps the input embedding {name!r}, so ensure_weight_tying=True cannot tie "
                    f"{tied} to a trained copy of it; set ensure_weight_tying=False ({tied} then train as their own "
                    "copy)"
                )
            raise ValueError(
                f"P-tuning v1 wraps the input embedding {name!r} for its virtual tokens, so modules_to_save cannot "
                f"also train it in full; remove {entry!r} from modules_to_save (other modules, e.g. 'lm_head', may "
                "stay)"
            )
        return peft_config
