"""Every number a training command is given, checked before any work: one line that names the fix.

`check_numbers(dataclass_types, values)` runs on the parsed values before the arguments dataclasses are built (so
before a model is built or data tokenized). Each number must be finite (no NaN, no infinity), and within the
bounds declared for its field: `ge` / `gt` / `le` / `lt` (and an optional `bound_hint`) in the field's metadata, or,
for `transformers.TrainingArguments` fields that transformers itself leaves unchecked, in `TRAINING_BOUNDS` below.
A run must also train at least one step (`check_training_length`). A count above what exists (`at_most`: more
evaluation samples than the split holds) is clamped with one warning line.

    --learning_rate nan   -> "--learning_rate nan is not a number; pass a finite value (e.g. 0.001)"
    --per_device_train_batch_size 0 -> "--per_device_train_batch_size 0 must be at least 1"
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

from transformers import TrainingArguments

from hf_llmkit.cli.options import BOUND_KEYS

__all__ = ["TRAINING_BOUNDS", "at_most", "check_numbers", "check_training_length", "describe_bounds"]

logger = logging.getLogger(__name__)

_SEED = {"ge": 0, "le": 2**32 - 1}  # numpy's seed range, which transformers' set_seed uses
_RATE = {"ge": 0, "lt": 1}
# TrainingArguments fields people type, with the values that make sense (transformers accepts any number here
# and fails later, after the model is built and the data tokenized, or trains nothing).
TRAINING_BOUNDS: dict[str, dict[str, Any]] = {
    "learning_rate": {"gt": 0},
    "per_device_train_batch_size": {"ge": 1},
    "per_device_eval_batch_size": {"ge": 1},
    "gradient_accumulation_steps": {"ge": 1},
    "eval_accumulation_steps": {"ge": 1},
    "num_train_epochs": {"ge": 0},
    "max_steps": {"ge": -1, "bound_hint": "-1 trains for --num_train_epochs"},
    "warmup_steps": {"ge": 0, "bound_hint": "below 1 it is a share of the steps"},
    "weight_decay": {"ge": 0},
    "max_grad_norm": {"ge": 0, "bound_hint": "0 turns clipping off"},
    "adam_beta1": _RATE,
    "adam_beta2": _RATE,
    "adam_epsilon": {"gt": 0},
    "label_smoothing_factor": _RATE,
    "logging_steps": {"gt": 0},
    "save_steps": {"gt": 0},
    "eval_steps": {"gt": 0},
    "eval_delay": {"ge": 0},
    "save_total_limit": {"ge": 1, "bound_hint": "omit it to keep every checkpoint"},
    "seed": _SEED,
    "data_seed": _SEED,
    "dataloader_num_workers": {"ge": 0},
    "dataloader_prefetch_factor": {"ge": 1},
}
_TRAINING_FIELDS = {f.name for f in dataclasses.fields(TrainingArguments)}


def _text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe_bounds(bounds: Mapping[str, Any], *, integer: bool) -> str:
    """ "at least 1", "> 0", "between 0 and 100 (exclusive)", "in [0, 1)", ">= -1"..."""
    low = ("ge", bounds["ge"]) if "ge" in bounds else ("gt", bounds["gt"]) if "gt" in bounds else None
    high = ("le", bounds["le"]) if "le" in bounds else ("lt", bounds["lt"]) if "lt" in bounds else None
    if low and high:
        if low[0] == "gt" and high[0] == "lt":
            return f"between {_text(low[1])} and {_text(high[1])} (exclusive)"
        return f"in {'[' if low[0] == 'ge' else '('}{_text(low[1])}, {_text(high[1])}{']' if high[0] == 'le' else ')'}"
    if low:
        if low[0] == "ge" and integer and low[1] >= 1:
            return f"at least {low[1]}"
        return f"{'>=' if low[0] == 'ge' else '>'} {_text(low[1])}"
    if high:
        return f"{'<=' if high[0] == 'le' else '<'} {_text(high[1])}"
    return "valid"


def _within(value: float, bounds: Mapping[str, Any]) -> bool:
    return not (
        ("ge" in bounds and value < bounds["ge"])
        or ("gt" in bounds and value <= bounds["gt"])
        or ("le" in bounds and value > bounds["le"])
        or ("lt" in bounds and value >= bounds["lt"])
    )


def _bounds_of(dtype: type, field: dataclasses.Field) -> dict[str, Any]:
    declared = {key: field.metadata[key] for key in BOUND_KEYS if key in field.metadata}
    if not declared and issubclass(dtype, TrainingArguments) and field.name in _TRAINING_FIELDS:
        return TRAINING_BOUNDS.get(field.name, {})
    return declared


def check_numbers(
    dataclass_types: Iterable[type], values: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> None:
    """Raise `ValueError` for the first number in `values` (by field name) that is NaN, infinite or out of the
    bounds its field declares (see the module docstring); `defaults` (the command's) give the example values."""
    defaults = defaults or {}
    for dtype in dataclass_types:
        for field in dataclasses.fields(dtype):
            value = values.get(field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            flag = f"--{field.name}"
            if isinstance(value, float) and math.isnan(value):
                raise ValueError(f"{flag} nan is not a number; pass a finite value{_example(field, defaults)}")
            if isinstance(value, float) and math.isinf(value):
                raise ValueError(f"{flag} {value} is not finite; pass a finite value{_example(field, defaults)}")
            bounds = _bounds_of(dtype, field)
            if bounds and not _within(value, bounds):
                hint = f" ({bounds['bound_hint']})" if "bound_hint" in bounds else ""
                condition = describe_bounds(bounds, integer=isinstance(value, int))
                raise ValueError(f"{flag} {value} must be {condition}{hint}")


def _example(field: dataclasses.Field, defaults: Mapping[str, Any]) -> str:
    default = defaults.get(field.name, field.default)
    if isinstance(default, (int, float)) and not isinstance(default, bool) and math.isfinite(default):
        return f" (e.g. {_text(default)})"
    return ""


def check_training_length(values: Mapping[str, Any]) -> None:
    """A training run must train: `--max_steps 0`, or `--max_steps -1` with `--num_train_epochs 0`, would save the
    untrained model and exit 0."""
    if not values.get("do_train", True):
        return
    if values["max_steps"] == 0:
        raise ValueError(
            "--max_steps 0 trains nothing; pass a positive number of steps (or -1 for --num_train_epochs)"
        )
    if values["max_steps"] < 0 and values["num_train_epochs"] <= 0:
        raise ValueError(
            f"--num_train_epochs {values['num_train_epochs']} trains nothing (--max_steps -1 trains for that "
            "many epochs); pass a positive --num_train_epochs or --max_steps"
        )


def at_most(asked: int | None, available: int, *, flag: str, what: str, warn: bool = True) -> int:
    """`asked` (None: all), clamped to the `available` `what` ("validation examples"), with one warning line when
    it is more than there are."""
    if asked is None or asked <= available:
        return available if asked is None else asked
    if warn:
        logger.warning("%s %d is more than the %d %s: using all %d", flag, asked, available, what, available)
    return available
