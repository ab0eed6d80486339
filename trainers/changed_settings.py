"""Settings a user may change when resuming a run: recorded in each checkpoint, reported in one line, applied.

A run resumed with another learning rate, length, schedule, logging, save cadence or clipping continues with the new
values (every other setting that shapes the checkpoint is part of the run's identity and refused:
`hf_llmkit.trainers.run_identity`). The Trainer alone would keep the old learning rate: `optimizer.pt` restores each
parameter group's rate and `scheduler.pt` the schedule's base rates. `apply_optimizer_changes` puts the new rate
into the groups that had the old one (groups a custom optimizer set apart keep theirs) and rescales the current rate,
so a warm-up or decay in progress continues from the same point of its shape with the new peak. The length, warm-up
and schedule type take effect through the schedule the Trainer builds from the arguments (the step count is
restored, the shape is not). The Trainer restores the logging, evaluation and save cadence from
`trainer_state.json` too (with a warning): `apply_changed_settings` sets them from the arguments again; clipping is
read from the arguments at every step.
"""

from __future__ import annotations

import math
from typing import Any

from hf_llmkit.compat.accelerate import unwrap_scheduler

__all__ = ["SETTINGS", "apply_changed_settings", "changed_settings", "describe_changes", "recorded_settings"]

# The TrainingArguments fields a resume may change.
SETTINGS = (
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "max_steps",
    "num_train_epochs",
    "max_grad_norm",
    "logging_steps",
    "save_steps",
    "save_total_limit",
    "eval_steps",
)


def _plain(value: Any) -> Any:
    enum_value = getattr(value, "value", None)
    return enum_value if isinstance(enum_value, str) else value


def recorded_settings(args) -> dict[str, Any]:
    """The changeable settings of `args`, as the run record stores them."""
    return {name: _plain(getattr(args, name, None)) for name in SETTINGS}


def changed_settings(recorded: dict | None, current: dict) -> list[tuple[str, Any, Any]]:
    """(name, recorded value, current value) for every changeable setting that differs (none before a record)."""
    if not isinstance(recorded, dict):
        return []
    return [(name, recorded[name], new) for name, new in current.items() if name in recorded and recorded[name] != new]


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{name} {old} -> {new}" for name, old, new in changes)


_SCHEDULE = {"learning_rate", "lr_scheduler_type", "warmup_steps", "max_steps", "num_train_epochs"}
_CADENCE = {"logging_steps", "save_steps", "eval_steps"}


def apply_changed_settings(trainer, changes: list[tuple[str, Any, Any]]) -> None:
    """At the first step after a resume (optimizer, scheduler and state are the checkpoint's by then)."""
    apply_optimizer_changes(trainer.optimizer, trainer.lr_scheduler, changes)
    if {name for name, _, _ in changes} & _CADENCE:  # the Trainer took them from trainer_state.json
        trainer.state.compute_steps(trainer.args, trainer.state.max_steps)


def apply_optimizer_changes(optimizer, scheduler, changes: list[tuple[str, Any, Any]]) -> None:
    """Continue on the schedule the new arguments describe, at the restored step.

    A new learning rate replaces the base rate of every parameter group that started from the recorded one (and
    the schedule's), and a group that ran at a fixed fraction of it (`lr_scale`, DKM's latent weights) runs at
    that fraction of the new one; after any schedule change each group's current rate is recomputed from the new
    schedule at the restored step (the Trainer's schedules are `LambdaLR`s), so the next update uses the rate an
    uninterrupted run with the new settings would use."""
    names = {name for name, _, _ in changes}
    if optimizer is None or not names & _SCHEDULE:
        return
    scheduler = unwrap_scheduler(scheduler) if scheduler is not None else None
    base_lrs, lambdas = getattr(scheduler, "base_lrs", None), getattr(scheduler, "lr_lambdas", None)
    old, new = next(((old, new) for name, old, new in changes if name == "learning_rate"), (None, None))
    for index, group in enumerate(optimizer.param_groups):
        factor = group.get("lr_scale", 1.0)  # a group at a fixed fraction of the rate (DKM's latent weights) keeps it
        if old and math.isclose(group.get("initial_lr", old * factor), old * factor):  # started from the recorded rate
            group["lr"], group["initial_lr"] = group["lr"] * new / old, new * factor
            if base_lrs is not None and index < len(base_lrs):
                base_lrs[index] = new * factor
        if base_lrs is not None and lambdas is not None and index < len(lambdas):
            group["lr"] = base_lrs[index] * lambdas[index](scheduler.last_epoch)
