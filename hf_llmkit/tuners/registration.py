"""Registering hf_llmkit's tuners with peft.

peft keeps its own method names in `PeftType`, a closed `(str, Enum)`, and `peft.utils.register_peft_method` refuses
any other name. peft itself only ever compares, hashes and serialises a config's `peft_type` as the string stored in
`adapter_config.json`, so our methods carry members of their own `(str, Enum)`, `LLMKitPeftType`: equal to (and
hashing like) that string, with the `.value` transformers' `load_adapter` reads. `register_tuner` fills peft's
mapping tables with them (hf_llmkit.compat.peft) and is a no-op when the method is already registered (re-importing
hf_llmkit, or importing it after peft).
"""

from __future__ import annotations

import enum

from hf_llmkit.compat import peft as peft_compat


class LLMKitPeftType(str, enum.Enum):
    """The `peft_type` of hf_llmkit's methods (written to `adapter_config.json` as the member's value)."""

    BOTTLENECK = "BOTTLENECK"
    BITFIT = "BITFIT"
    PTUNING = "PTUNING"
    PTUNING_V2 = "PTUNING_V2"


def register_tuner(*, name: str, config_cls: type, model_cls: type, is_mixed_compatible: bool = False) -> None:
    """Register a layer-injecting tuner with peft under `name` (lower case), once per process."""
    if name != name.lower() or name.upper() not in LLMKitPeftType.__members__:
        raise ValueError(
            f"{name!r} is not one of hf_llmkit's PEFT methods {[m.value.lower() for m in LLMKitPeftType]}; add its "
            "upper-case name to LLMKitPeftType first."
        )
    peft_type = LLMKitPeftType[name.upper()]
    registered = peft_compat.registered_config(peft_type)
    if registered is config_cls:
        return
    if registered is not None:
        if _qualname(registered) != _qualname(config_cls):
            raise ValueError(
                f"PEFT method {name!r} is already registered with {_qualname(registered)}; register "
                f"{_qualname(config_cls)} under another name."
            )
        # Same class re-created (importlib.reload, or a module imported twice under two names): point peft's
        # mappings at the new objects instead of failing as peft's own registration would.
        peft_compat.unregister_method(peft_type)
    prefix = model_cls.prefix
    if prefix != name + "_":
        raise ValueError(f"{_qualname(model_cls)}.prefix must be {name + '_'!r} (peft's convention), got {prefix!r}")
    taken = {t: p for t, p in peft_compat.registered_prefixes().items() if p == prefix}
    if taken:
        raise ValueError(f"the parameter prefix {prefix!r} is already used by PEFT method {next(iter(taken))}")
    peft_compat.register_method(
        peft_type=peft_type,
        config_cls=config_cls,
        model_cls=model_cls,
        prefix=prefix,
        is_mixed_compatible=is_mixed_compatible,
    )


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
