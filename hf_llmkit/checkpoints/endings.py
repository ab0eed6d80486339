"""How a run ends early: why a callback stopped it (`StopRequest`), and the errors that end the run.

Callbacks never exit the process or mutate the arguments. A callback that needs the run to end (a preemption
signal, a diverged loss) sets `control.should_training_stop` (and `should_save` for a preemption), lets the step's
saves finish, and then raises the matching error below with its `StopRequest` attached, under every Trainer alike.
A trainer that can do more catches it: `LLMKitTrainer` restarts from the last complete checkpoint on a `"rollback"`
request; everything else ends the run.

The errors below are `RuntimeError`s (so `except Exception` catches them) that are also `SystemExit`s: left
uncaught, the interpreter exits with their `code` and prints no traceback. Whoever raises one logs its one-line
message first (main process only).

- `TrainingInterrupted`: SIGTERM / SIGUSR1 stopped the run after a complete checkpoint; re-run the command to go
  on. Exit status 143 (`LLMKitTrainingArguments.preemption_exit_code`, or the callback's `exit_code`).
- `TrainingDivergedError`: the loss went NaN/Inf or spiked beyond `max_rollbacks`. Exit status 3
  (`divergence_exit_code`).
- `CheckpointWriteError`: a disk-full or permission error during a save; the last complete checkpoint is untouched.
  Exit status 74 (EX_IOERR).
- `ResumeError`: the run cannot start (a checkpoint it cannot resume from, an output folder it cannot use). Exit
  status 2.

The statuses come from one table, `hf_llmkit.checkpoints.exit_codes`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hf_llmkit.checkpoints.exit_codes import EXIT_DIVERGED, EXIT_IO_ERROR, EXIT_PREEMPTED, EXIT_USAGE

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointWriteError",
    "ResumeError",
    "RunEndingError",
    "StopRequest",
    "TrainingDivergedError",
    "TrainingInterrupted",
]


class RunEndingError(RuntimeError, SystemExit):
    """An error that ends a training run with its own exit code (uncaught: no traceback, exit status `code`)."""

    default_code = 1

    def __init__(self, message: str, *, exit_code: int | None = None, request: StopRequest | None = None):
        super().__init__(message)
        self.code = self.default_code if exit_code is None else exit_code
        self.request = request  # why a callback stopped the run (None: not a callback's stop)
        self.logged = False  # set once its one line was logged

    @property
    def exit_code(self) -> int:
        return self.code


class TrainingInterrupted(RunEndingError):
    """Stopped by a preemption signal after saving a complete checkpoint; re-running the command continues."""

    default_code = EXIT_PREEMPTED


class TrainingDivergedError(RunEndingError):
    """The loss went NaN/Inf or spiked more often than `max_rollbacks` allows, or there was nothing to roll back to."""

    default_code = EXIT_DIVERGED


class CheckpointWriteError(RunEndingError):
    """A checkpoint could not be written (disk full, no permission, read-only filesystem); the last complete one
    is untouched. The original `OSError` / `RuntimeError` is the `__cause__`."""

    default_code = EXIT_IO_ERROR


class ResumeError(RunEndingError, ValueError):
    """This run cannot start: it cannot resume from that checkpoint (wrong folder, corrupt, another run's, model-only
    where an exact resumption is asked for), its output folder cannot be written, or its checkpoint settings exclude
    each other (transformers' JIT checkpoint and `FaultToleranceCallback` both on SIGTERM). Exit status 2."""

    default_code = EXIT_USAGE


@dataclass(frozen=True)
class StopRequest:
    """Why a callback stopped training, carried by the error it raises.

    `kind` is `"rollback"` (restart from `checkpoint` as if the steps up to `step` had run: the data window in
    between is skipped), `"diverged"` (no rollback left: end the run) or `"preempted"` (a signal; the checkpoint
    at `step` is complete: end the run with `exit_code`, or the arguments' `preemption_exit_code` when None).
    """

    kind: str
    step: int
    reason: str
    checkpoint: str | None = None
    rollbacks: int = 0
    exit_code: int | None = None


def log_once(message: str, *, is_main_process: bool, level: int = logging.ERROR) -> None:
    """Log the one line that explains a run's end, from the main process only."""
    if is_main_process:
        logger.log(level, "%s", message)


def logged(error: RunEndingError, *, is_main_process: bool, level: int = logging.ERROR) -> RunEndingError:
    """`error`, its one line logged (once, from the main process): `raise logged(SomeError(...), ...)`."""
    if not error.logged:
        log_once(str(error), is_main_process=is_main_process, level=level)
        error.logged = True
    return error
