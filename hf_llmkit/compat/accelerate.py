"""accelerate internals hf_llmkit relies on (checked against accelerate 1.15.0).

- `model._is_accelerate_prepared`: the mark `Accelerator.prepare_model` leaves on a model it prepared (also in
  `evaluation_mode`, where it does not wrap the model in DDP); a marked model is never prepared again.
- `Accelerator._models`: the models the accelerator tracks (for `save_state`, `free_memory`, `unwrap`).
- `AcceleratorState._reset_state()`: forgets the process-wide accelerator state, so a second `Accelerator` (a second
  Trainer with another DeepSpeed config in one process) can be made. accelerate's and transformers' own tests reset
  it the same way; hf_llmkit's multi-rank test scripts do (`reset_accelerator_state`), the library never does.
- `Accelerator.ddp_handler`: the `DistributedDataParallelKwargs` handler whose `to_kwargs()` and
  `register_comm_hook(model)` accelerate calls when it wraps a model in DDP. Expert parallelism replaces it
  (`replace_ddp_handler`) to skip DDP's start-up broadcast and reduce expert gradients over their replicas only;
  accelerate offers no public way to pass a communication hook with its state.
- `AcceleratedOptimizer.optimizer`: the wrapped torch optimizer (`unwrap_optimizer`), for state-dict hooks on the
  real optimizer and for a second `Trainer.train` (a rollback) that must not wrap the wrapper again;
  `AcceleratedScheduler.scheduler` likewise (`unwrap_scheduler`): a resume with a new learning rate sets its base
  rates.

- `ACCELERATE_USE_PARALLELISM_CONFIG`: the environment variable `accelerate launch --parallelism_config_*` sets so
  that the `Accelerator` builds a `ParallelismConfig()` from the `PARALLELISM_CONFIG_*` variables
  (`launcher_parallelism_config` builds the same one, so our sequence parallelism can refuse the launcher's before
  any work: `hf_llmkit.parallel.host_clashes`).

`LLMKitTrainer` forgets an evaluation-only preparation before training (hf_llmkit.trainers.eval_preparation): no
public API undoes `prepare_model`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

CHECKED_AGAINST = "1.15.0"
PREPARED_MARK = "_is_accelerate_prepared"

__all__ = [
    "CHECKED_AGAINST",
    "PREPARED_MARK",
    "forget_prepared_model",
    "is_prepared",
    "launcher_parallelism_config",
    "replace_ddp_handler",
    "reset_accelerator_state",
    "unwrap_optimizer",
    "unwrap_scheduler",
]


def is_prepared(model) -> bool:
    """Whether `Accelerator.prepare_model` has prepared `model` (wrapped or not)."""
    return bool(getattr(model, PREPARED_MARK, False))


def forget_prepared_model(accelerator, model) -> None:
    """Undo the bookkeeping of `prepare_model(model, evaluation_mode=True)` so `model` can be prepared again."""
    if PREPARED_MARK in vars(model):
        delattr(model, PREPARED_MARK)
    accelerator._models[:] = [m for m in accelerator._models if m is not model]


def reset_accelerator_state() -> None:
    """Forget the process-wide `AcceleratorState` (not the process group): the next `Accelerator` starts afresh."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def replace_ddp_handler(accelerator, make: Callable[[Any], Any]) -> None:
    """Set `accelerator.ddp_handler` to `make(current handler or None)`; the result must offer `to_kwargs()` and
    `register_comm_hook(model)`, which accelerate calls when it wraps a model in DDP."""
    accelerator.ddp_handler = make(accelerator.ddp_handler)


def unwrap_optimizer(optimizer):
    """The torch optimizer inside accelerate's `AcceleratedOptimizer` (the optimizer itself when not wrapped)."""
    from accelerate.optimizer import AcceleratedOptimizer

    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def unwrap_scheduler(scheduler):
    """The torch scheduler inside accelerate's `AcceleratedScheduler` (the scheduler itself when not wrapped)."""
    from accelerate.scheduler import AcceleratedScheduler

    return scheduler.scheduler if isinstance(scheduler, AcceleratedScheduler) else scheduler


def launcher_parallelism_config() -> Any:
    """The `ParallelismConfig` an `Accelerator` builds from what `accelerate launch --parallelism_config_*` put in
    the environment, or None when the launcher asked for none."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return None
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig()
