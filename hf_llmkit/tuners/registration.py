"""Registering hf_llmkit's tuners with peft.

peft keeps its own method names in `PeftType`, a closed `(str, Enum)`, and `peft.utils.register_peft_method` refuses
any other name. peft itself only ever compares, hashes and serialises a config's `peft_type` as the string stored in
`adapter_config.json`, so our methods carry members of their own `(str, Enum)`, `LLMKitPeftType`: equal to (and
hashing like) that string, with the `.value` transformers' `load_adapter` reads. `register_tuner` fills peft's
mapping tables with them (hf_llmkit.compat.peft) and is a no-op when the method is already registered (re-importing
hf_llmkit, or importing it after peft).

`PEFT_METHODS` is the one list of the methods hf_llmkit offers (peft's LoRA first, then ours in registration order),
each with its config class and display name: the training commands' `--peft_method` choices and flags, their
results table and the composition matrix all read it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from peft import LoraConfig

from hf_llmkit.compat import peft as peft_compat


@dataclass(frozen=True)
class PeftMethod:
    """A PEFT method hf_llmkit offers.

    Args:
        name: `--peft_method` value, lower case (`"bottleneck"`); the training commands' flags of the method are
            `--<name>_<config field>`.
        config_cls: The peft config dataclass; its fields (with `metadata={"help": ...}`) are the method's options.
        display_name: How tables and reports name the method ("P-tuning v2").
        summary: Format string over the config's fields that a results table appends ("rank {r}"), or "".
    """

    name: str
    config_cls: type
    display_name: str
    summary: str = ""

    def describe(self, config) -> str:
        """`display_name`, with `summary` filled from `config` in parentheses when there is one."""
        return f"{self.display_name} ({self.summary.format_map(vars(config))})" if self.summary else self.display_name


PEFT_METHODS: dict[str, PeftMethod] = {
    "lora": PeftMethod("lora", LoraConfig, "LoRA", "rank {r}, alpha {lora_alpha:g}"),  # peft's own
}


class LLMKitPeftType(str, enum.Enum):
    """The `peft_type` of hf_llmkit's methods (written to `adapter_config.json` as the member's value)."""

    BOTTLENECK = "BOTTLENECK"
    BITFIT = "BITFIT"
    PTUNING = "PTUNING"
    PTUNING_V2 = "PTUNING_V2"


def register_tuner(
    *,
    name: str,
    config_cls: type,
    model_cls: type,
    display_name: str | None = None,
    summary: str = "",
    is_mixed_compatible: bool = False,
) -> None:
    """Register a layer-injecting tuner with peft under `name` (lower case), once per process, and list it in
    `PEFT_METHODS` (`display_name`, default `name`, and `summary` as in `PeftMethod`)."""
    if name != name.lower() or name.upper() not in LLMKitPeftType.__members__:
        raise ValueError(
            f"{name!r} is not one of hf_llmkit's PEFT methods {[m.value.lower() for m in LLMKitPeftType]}; add its "
            "upper-case name to LLMKitPeftType first."
        )
    peft_type = LLMKitPeftType[name.upper()]
    registered = peft_compat.registered_config(peft_type)
    if registered is config_cls:
        _list_method(name, config_cls, display_name, summary)
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
    _list_method(name, config_cls, display_name, summary)


def _list_method(name: str, config_cls: type, display_name: str | None, summary: str) -> None:
    known = PEFT_METHODS.get(name)  # a re-registration without names keeps the ones given first
    display_name = display_name or (known.display_name if known else name)
    PEFT_METHODS[name] = PeftMethod(name, config_cls, display_name, summary or (known.summary if known else ""))


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
