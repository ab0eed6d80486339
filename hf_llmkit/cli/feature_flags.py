"""Flags that belong to a feature: passing them while the feature is off is an error, not a silent no-op.

An arguments dataclass lists its feature's flags in `flag_groups` (a class attribute); the command-line parser
checks, after parsing, that no flag the user typed belongs to a feature that is switched off:

    @dataclass
    class DKMArguments:
        quantization: str | None = None
        dkm_bits: int = 3
        flag_groups: ClassVar = (
            FlagGroup(switch="--quantization dkm", flags=("dkm_bits",), is_on=lambda a: a["quantization"] == "dkm"),
        )

    run_clm.py --dkm_bits 4
    run_clm.py: error: --dkm_bits has no effect without --quantization dkm; add --quantization dkm or drop --dkm_bits
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FlagGroup", "check_feature_flags"]


@dataclass(frozen=True)
class FlagGroup:
    """Flags (dataclass field names) that only act when `is_on(values)` holds.

    Args:
        switch: How the user switches the feature on, as typed on the command line (e.g. "--peft_method lora").
        flags: The feature's own flags (field names, without dashes).
        is_on: Given every parsed value by field name, whether the feature is on.
        when_off: For a feature switched on by leaving something out (e.g. training from scratch): the message
            names this situation instead ("with --model_name_or_path ...") and only suggests dropping the flag.
    """

    switch: str
    flags: tuple[str, ...]
    is_on: Callable[[Mapping[str, Any]], bool]
    when_off: str | None = None


def check_feature_flags(groups: Iterable[FlagGroup], values: Mapping[str, Any], given: Iterable[str]) -> None:
    """Raise `ValueError` for the first flag in `given` (the flags the user typed) whose feature is off."""
    given = set(given)
    for group in groups:
        stray = [flag for flag in group.flags if flag in given]
        if stray and not group.is_on(values):
            names = " ".join(f"--{flag}" for flag in stray)
            has = "has" if len(stray) == 1 else "have"
            if group.when_off is not None:
                raise ValueError(f"{names} {has} no effect {group.when_off}; drop {names}")
            raise ValueError(f"{names} {has} no effect without {group.switch}; add {group.switch} or drop {names}")
