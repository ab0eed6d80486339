"""Registering hf_llmkit's tuners with peft.

peft keeps its method names in `PeftType`, a closed `(str, Enum)` that cannot be subclassed, and
`peft.utils.register_peft_method` refuses a name that is not a member. `extend_peft_type` adds one member to
the existing enum the way `EnumMeta` would have built it; it is the only place hf_llmkit touches peft's
internals. `register_tuner` then uses peft's official registration, and is a no-op when the method is already
registered (re-importing hf_llmkit, or importing it in a process where peft was imported first).
"""

from __future__ import annotations

import enum

from peft.utils.peft_types import PeftType


def extend_peft_type(name: str) -> PeftType:
    """Return `PeftType[name]`, adding the member first if peft does not know it (Python 3.10-3.13)."""
    if name in PeftType.__members__:
        return PeftType[name]
    member = str.__new__(PeftType, name)
    member._name_ = name
    member._value_ = name
    member.__objclass__ = PeftType
    member.__init__(name)
    member._sort_order_ = len(PeftType._member_names_)
    PeftType._member_map_[name] = member
    PeftType._value2member_map_[name] = member
    PeftType._member_names_.append(name)
    # Python >= 3.12 looks members up as class attributes (EnumMeta.__getattr__ no longer consults the map);
    # setting it through type.__setattr__ bypasses EnumMeta's guard against reassigning members.
    type.__setattr__(PeftType, name, member)
    assert isinstance(PeftType(name), enum.Enum) and PeftType[name] is member
    return member


def register_tuner(*, name: str, config_cls: type, model_cls: type, is_mixed_compatible: bool = False) -> None:
    """Register a layer-injecting tuner with peft under `name` (lower case), once per process."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
    from peft.utils import register_peft_method

    peft_type = extend_peft_type(name.upper())
    registered = PEFT_TYPE_TO_CONFIG_MAPPING.get(peft_type)
    if registered is config_cls:
        return
    if registered is not None:
        if _qualname(registered) != _qualname(config_cls):
            raise ValueError(
                f"PEFT method {name!r} is already registered with {_qualname(registered)}; register "
                f"{_qualname(config_cls)} under another name."
            )
        # Same class re-created (importlib.reload, or a module imported twice under two names): point peft's
        # mappings at the new objects instead of failing with peft's "already registered" KeyError.
        _unregister(peft_type)
    register_peft_method(
        name=name,
        config_cls=config_cls,
        model_cls=model_cls,
        prefix=model_cls.prefix,
        is_mixed_compatible=is_mixed_compatible,
    )


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _unregister(peft_type: PeftType) -> None:
    from peft import mapping

    for table in (
        mapping.PEFT_TYPE_TO_CONFIG_MAPPING,
        mapping.PEFT_TYPE_TO_TUNER_MAPPING,
        mapping.PEFT_TYPE_TO_MIXED_MODEL_MAPPING,
        mapping.PEFT_TYPE_TO_PREFIX_MAPPING,
    ):
        table.pop(peft_type, None)
