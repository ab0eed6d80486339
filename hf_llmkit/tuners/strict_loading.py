"""hf_llmkit's PEFT methods load strictly: an adapter that does not fit the model is an error naming the keys.

peft loads adapter weights with `load_state_dict(strict=False)` and only warns about what did not fit, so an adapter
of a 2-layer model silently loads onto a 1-layer base (dropping a layer), and an adapter whose `peft_type` was edited
to another method loads as an untrained adapter. For our tuners, a load-state-dict pre-hook notes which of the
tuner's adapters the incoming weights are for, and a post-hook raises `ValueError` when

- an adapter being loaded misses weights the model has for it (e.g. a layer the file does not cover), or
- the incoming weights hold keys the model has no place for (a layer the model lacks, another method's weights).

Loads that touch none of our adapters (a base-model state dict) are left to the caller, as before. The hooks are
public `torch.nn.Module` hooks on the tuner (`BaseTuner`) module, installed from its `_post_injection_hook`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["enforce_strict_loading", "install_strict_loading"]

_SHOWN = 6


def _adapter_of(key: str, prefix: str) -> str | None:
    """The adapter name in a model key (the segment after the tuner's own, e.g. `bottleneck_down.default.weight`)."""
    segments = key.split(".")
    for index, segment in enumerate(segments[:-1]):
        if segment.startswith(prefix):
            return segments[index + 1]
    return None


def _adapters_in(keys: list[str], tuner: nn.Module) -> set[str]:
    return {name for key in keys if (name := _adapter_of(key, tuner.prefix)) in tuner.peft_config}


def install_strict_loading(tuner: nn.Module) -> None:
    """Register the strict-loading hooks on one tuner module (once)."""
    if getattr(tuner, "_strict_loading_installed", False):
        return
    tuner._strict_loading_installed = True
    loads: list[tuple[str, int, set[str]]] = []  # (prefix, incoming keys, our adapters among them) per load

    def before(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        keys = [key for key in state_dict if key.startswith(prefix)]
        loads.append((prefix, len(keys), _adapters_in(keys, module)))

    def after(module, incompatible: Any) -> None:
        if not loads:
            return
        prefix, incoming, ours = loads.pop()
        missing = [
            key
            for key in incompatible.missing_keys
            if key.startswith(prefix) and _adapter_of(key, module.prefix) in ours
        ]
        unexpected = [key for key in incompatible.unexpected_keys if key.startswith(prefix)]
        nothing_fit = incoming > 0 and len(unexpected) == incoming  # e.g. another method's weights
        if not missing and not (unexpected and (ours or nothing_fit)):
            return
        names = sorted(ours) or sorted(module.peft_config)
        method = getattr(module.peft_config[names[0]], "peft_type", type(module).__name__)
        method = getattr(method, "value", method)
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} key(s) {_short(missing, prefix)}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)} key(s) {_short(unexpected, prefix)}")
        raise ValueError(
            f"the adapter weights do not fit this {method} model: {'; '.join(problems)}. Load the adapter onto the "
            "base model it was trained on (same architecture and number of layers), with the peft_type it was "
            "saved with"
        )

    tuner.register_load_state_dict_pre_hook(before)
    tuner.register_load_state_dict_post_hook(after)


def _short(keys: list[str], prefix: str) -> str:
    shown = [key[len(prefix) :] for key in keys[:_SHOWN]]
    return str(shown) + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def enforce_strict_loading(model_cls: type) -> type:
    """Make every instance of our tuner class `model_cls` load strictly (wraps its `_post_injection_hook`)."""
    if model_cls.__dict__.get("_strict_loading_enforced"):
        return model_cls
    inherited = model_cls._post_injection_hook

    def _post_injection_hook(self, model, config, adapter_name):
        inherited(self, model, config, adapter_name)
        install_strict_loading(self)

    model_cls._post_injection_hook = _post_injection_hook
    model_cls._strict_loading_enforced = True
    return model_cls
