"""Merging an adapter into a model that saves and reloads equal to the adapter model (`merge_and_unload` +
`save_pretrained` + `from_pretrained`), used by `--merge_adapter` and `SavePeftModelCallback(save_merged=True)`.

- `merge_problem(peft_model)`: why the merged model would reload different (BitFit biases on layers the
  architecture builds without one, whatever its config says: Qwen2's `o_proj` and MLP, every Mistral projection),
  or None.
- `merge_for_saving(peft_model)`: `untie_adapted_embeddings`, then peft's `merge_and_unload` (in place).
- `untie_adapted_embeddings(peft_model)`: before merging, an adapter on an embedding tied to the output layer (LoRA
  `target_modules=["embed_tokens"]`: peft adapts the input side only) gets an output layer of its own.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["merge_for_saving", "merge_problem", "untie_adapted_embeddings"]


def merge_problem(peft_model: Any) -> str | None:
    """Why `peft_model` merged, saved and reloaded would not be the adapter model; None when it would be."""
    undeclared = getattr(peft_model.base_model, "undeclarable_biases", list)()
    if not undeclared:
        return None
    kind = getattr(peft_model.get_base_model().config, "model_type", type(peft_model.get_base_model()).__name__)
    return (
        f"a {kind} model's config cannot declare the biases BitFit adds to its bias-less layers (e.g. "
        f"{undeclared[0]}), so the merged model would reload without them"
    )


def untie_adapted_embeddings(peft_model: Any) -> bool:
    """Before merging: an adapter layer on an embedding tied to the output layer adapted one side only, and merged
    into the shared weight it would change both. The output layer gets its own copy of the base weight and the config
    stops tying, so the merged model (and its reload) computes what the adapter model did. Returns whether it
    untied."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = peft_model.get_base_model()
    inputs, outputs = base.get_input_embeddings(), base.get_output_embeddings()
    if outputs is None or not (isinstance(inputs, BaseTunerLayer) or isinstance(outputs, BaseTunerLayer)):
        return False
    inputs, outputs = (m.get_base_layer() if isinstance(m, BaseTunerLayer) else m for m in (inputs, outputs))
    if getattr(outputs, "weight", None) is None or outputs.weight is not getattr(inputs, "weight", None):
        return False
    outputs.weight = torch.nn.Parameter(outputs.weight.detach().clone(), requires_grad=False)
    for config in {id(c): c for c in (base.config, base.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    return True


def merge_for_saving(peft_model: Any) -> Any:
    """The plain model to save for `peft_model` (merged in place, so pass a copy to keep the adapter): an output layer
    tied to an adapted embedding untied first, so the merged model computes what the adapter model did."""
    untie_adapted_embeddings(peft_model)
    return peft_model.merge_and_unload()
