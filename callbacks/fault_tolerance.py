"""`FaultToleranceCallback`: checkpoints that survive kills, clean preemption, and rollback on NaN/spiking loss.

- **Complete checkpoints.** After every save, once all ranks have finished writing, the main process writes a
  manifest (files, sizes, checksums) into the checkpoint, last; only then does the checkpoint count. Resume, rotation
  and verification share one classifier (`hf_llmkit.checkpoints.status`): only our own interrupted writes
  are ever deleted unasked, corrupt checkpoints are moved aside, checkpoints without a manifest (a plain `Trainer`,
  an older version) are validated by loading and resumed from. After each manifest the callback applies
  `save_total_limit` itself (never deleting the newest complete checkpoint).
- **Preemption.** SIGTERM / SIGUSR1 make every rank save at the next step boundary and stop. The run then ends with
  `TrainingInterrupted`, exit status 143 by default (`exit_code`, or `LLMKitTrainingArguments.preemption_exit_code`):
  a preempted run is not a finished one, and re-running the same command continues it.
- **Divergence.** A NaN/Inf training loss, a loss above `loss_spike_factor` x its running average, or non-finite
  weights at save time roll training back to the last complete checkpoint and skip the data since then, at most
  `max_rollbacks` times, then end the run with `TrainingDivergedError` (exit status 3 when uncaught). The rollback
  count and the loss average are `ExportableState` attributes: they survive a resume.

The callback only asks, through `control`: with `LLMKitTrainer` (whose `RequestingControl` carries a `StopRequest`)
the trainer rolls back or ends the run, retries transient I/O errors during a save, and with `auto_resume=True`
resumes from the newest complete checkpoint. With a plain `Trainer` the callback raises the matching error itself
once the step's saves are done, and the Trainer's own `save_total_limit` rotation (which runs before the manifest
exists) stays in charge: prefer `LLMKitTrainer`.

Example:
    ```python
    from hf_llmkit import LLMKitTrainingArguments
    from hf_llmkit.callbacks import FaultToleranceCallback
    from hf_llmkit.testing import tiny_llama
    from hf_llmkit.trainers import LLMKitTrainer
    from datasets import Dataset

    ids = [[(7 * i + j) % 500 + 3 for j in range(16)] for i in range(32)]
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = LLMKitTrainingArguments(
        output_dir="outputs/ft", max_steps=8, save_steps=2, save_total_limit=2, auto_resume=True, report_to="none"
    )
    trainer = LLMKitTrainer(model=tiny_llama().train(), args=args, train_dataset=data,
                            callbacks=[FaultToleranceCallback()])
    trainer.train()  # run it again after a kill: it resumes from the newest complete checkpoint
    ```
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from hf_llmkit.checkpoints.collectives import any_rank, barrier, world_size
from hf_llmkit.checkpoints.endings import (
    RequestingControl,
    StopRequest,
    TrainingDivergedError,
    TrainingInterrupted,
    logged,
)
from hf_llmkit.checkpoints.housekeeping import drop_abandoned, remove_checkpoint, rotate_checkpoints, tidy_checkpoints
from hf_llmkit.checkpoints.loss_watch import LossWatch
from hf_llmkit.checkpoints.manifest import mark_writing, write_manifest
from hf_llmkit.checkpoints.retries import save_with_retries
from hf_llmkit.checkpoints.status import CheckpointState, classify_checkpoint, latest_complete_checkpoint

logger = logging.getLogger(__name__)


class FaultToleranceCallback(TrainerCallback, ExportableState):
    """Makes a Trainer run survive kills, preemption and loss blow-ups (see the module docstring).

    Args:
        checksum: `hashlib` algorithm for the manifest checksums, or None to record sizes only.
        fsync: Flush checkpoint files and the manifest to stable storage before the checkpoint counts.
        signals: Signal names that request a save-and-exit at the next step boundary.
        exit_code: Exit status of a run stopped by one of `signals` (after its checkpoint is complete); None uses
            `LLMKitTrainingArguments.preemption_exit_code` (default 143, the SIGTERM convention).
        max_rollbacks: How many NaN/spike rollbacks are allowed before `TrainingDivergedError`.
        loss_spike_factor: Roll back when a step's loss exceeds this multiple of its running average
            (None: only NaN/Inf losses roll back).
        loss_spike_warmup_steps: Steps of running average collected before spikes are judged.
        loss_ema_decay: Decay of the loss running average (closer to 1: longer memory).
        check_weights_on_save: Refuse to mark a checkpoint complete while a trainable weight is NaN/Inf.
        manifest_retries: Attempts to re-write the manifest after a transient I/O error.
    """

    def __init__(
        self,
        *,
        checksum: str | None = "sha256",
        fsync: bool = True,
        signals: tuple[str, ...] | list[str] = ("SIGTERM", "SIGUSR1"),
        exit_code: int | None = None,
        max_rollbacks: int = 3,
        loss_spike_factor: float | None = None,
        loss_spike_warmup_steps: int = 20,
        loss_ema_decay: float = 0.9,
        check_weights_on_save: bool = True,
        manifest_retries: int = 3,
    ):
        unknown = [name for name in signals if not isinstance(getattr(signal, str(name), None), signal.Signals)]
        if unknown:
            raise ValueError(f"unknown signal names {unknown}; use names such as 'SIGTERM' or 'SIGUSR1'")
        if exit_code is not None and not 0 <= exit_code <= 255:
            raise ValueError(f"exit_code must be in 0..255 (or None for the trainer's default), got {exit_code}")
        if max_rollbacks < 0:
            raise ValueError(f"max_rollbacks must be >= 0 (0 disables rollback), got {max_rollbacks}")
        if manifest_retries < 0:
            raise ValueError(f"manifest_retries must be >= 0, got {manifest_retries}")
        self.checksum, self.fsync, self.exit_code = checksum, fsync, exit_code
        self.signal_names = tuple(signals)
        self.signals = tuple(getattr(signal, name) for name in signals)
        self.max_rollbacks, self.manifest_retries = max_rollbacks, manifest_retries
        self.check_weights_on_save = check_weights_on_save
        self.watch = LossWatch(
            spike_factor=loss_spike_factor, warmup_steps=loss_spike_warmup_steps, ema_decay=loss_ema_decay
        )
        self.rollbacks = 0  # resumable state (see `state`)
        self._signal: int | None = None
        self._old_handlers: dict[int, object] = {}
        self._pending: StopRequest | None = None  # plain Trainer only: raised once the step's saves are done

    # -- ExportableState: what survives a resume ------------------------------------------------------------
    def state(self) -> dict:
        return {
            "args": {
                "checksum": self.checksum,
                "fsync": self.fsync,
                "signals": list(self.signal_names),
                "exit_code": self.exit_code,
                "max_rollbacks": self.max_rollbacks,
                "loss_spike_factor": self.watch.spike_factor,
                "loss_spike_warmup_steps": self.watch.warmup_steps,
                "loss_ema_decay": self.watch.ema_decay,
                "check_weights_on_save": self.check_weights_on_save,
                "manifest_retries": self.manifest_retries,
            },
            "attributes": {"rollbacks": self.rollbacks, "loss_ema": self.loss_ema, "good_steps": self.good_steps},
        }

    # the loss watch's running average, exposed as attributes so `from_state` / `setattr` restore it
    @property
    def loss_ema(self) -> float | None:
        return self.watch.ema

    @loss_ema.setter
    def loss_ema(self, value: float | None) -> None:
        self.watch.ema = value

    @property
    def good_steps(self) -> int:
        return self.watch.good_steps

    @good_steps.setter
    def good_steps(self, value: int) -> None:
        self.watch.good_steps = value

    # -- signals --------------------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if self._signal is None:
            logger.warning("received %s: saving at the next step boundary, then stopping", signal.Signals(signum).name)
        self._signal = signum

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("FaultToleranceCallback: not on the main thread, signal handlers not installed")
            return
        for signum in self.signals:
            if signum not in self._old_handlers:
                self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def close(self) -> None:
        """Restore the signal handlers and remove the loss hook. Runs at `on_train_end`; `LLMKitTrainer` also calls
        it when training ends with an exception."""
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers.clear()
        self.watch.detach()

    # -- requests -------------------------------------------------------------------------------------------
    def _stop(self, control, request: StopRequest) -> None:
        if isinstance(control, RequestingControl):
            control.request_stop(request)
        else:  # a plain Trainer: stop now, raise once this step's saves are done
            control.should_training_stop = True
            control.should_save = request.kind == "preempted"
            self._pending = self._pending or request

    def _diverged(self, args, state, control, reason: str) -> None:
        step = state.global_step
        if self.rollbacks >= self.max_rollbacks:
            message = (
                f"{reason} at step {step}, and {self.rollbacks} rollback(s) already used (max_rollbacks="
                f"{self.max_rollbacks}); lower the learning rate, inspect the data before step {step}, or raise "
                "max_rollbacks"
            )
            self._stop(control, StopRequest("diverged", step, message, rollbacks=self.rollbacks))
            return
        checkpoint = latest_complete_checkpoint(args.output_dir)
        if checkpoint is None:
            message = (
                f"{reason} at step {step} and no complete checkpoint in {args.output_dir} to roll back to; save more "
                "often (lower save_steps) or lower the learning rate"
            )
            self._stop(control, StopRequest("diverged", step, message, rollbacks=self.rollbacks))
            return
        self.rollbacks += 1
        logger.warning("%s at step %d: rolling back to %s (rollback %d)", reason, step, checkpoint, self.rollbacks)
        self._stop(control, StopRequest("rollback", step, reason, checkpoint=checkpoint, rollbacks=self.rollbacks))

    def _raise_pending(self, args, state) -> None:
        """Plain Trainer only: nobody else acts on the request, so the callback ends the run with an error."""
        request, self._pending = self._pending, None
        if request is None:
            return
        self.close()
        main = state.is_world_process_zero
        if request.kind == "preempted":
            message = preemption_message(request, args.output_dir)
            error = TrainingInterrupted(message, exit_code=request.exit_code)
            raise logged(error, is_main_process=main, level=logging.WARNING)
        message = f"training diverged: {request.reason}"
        if request.kind == "rollback":
            message = (
                f"training diverged: {request.reason} at step {request.step}; use hf_llmkit.trainers.LLMKitTrainer to "
                f"roll back automatically, or resume from {request.checkpoint} with a lower learning rate"
            )
        raise logged(TrainingDivergedError(message), is_main_process=main)

    # -- Trainer events -------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # Resumed from a checkpoint saved without this callback, the Trainer's save would fail with KeyError on
        # the missing `stateful_callbacks` entry (transformers 5.23): give it one.
        state.stateful_callbacks.setdefault(type(self).__name__, self.state())
        self._signal, self._pending = None, None
        self._install_signals()
        self.watch.attach(model)
        if not isinstance(control, RequestingControl):  # LLMKitTrainer tidies before it loads the checkpoint
            if state.is_world_process_zero:
                tidy_checkpoints(args.output_dir, resume_step=state.global_step)
                if args.save_total_limit:
                    logger.warning(
                        "save_total_limit with a plain Trainer: its rotation runs before the manifest is written "
                        "and counts incomplete folders; use hf_llmkit.trainers.LLMKitTrainer for manifest-aware "
                        "rotation"
                    )
            barrier()

    def on_step_end(self, args, state, control, **kwargs):
        signal_seen, nonfinite, loss = self.watch.verdict(args.device, signal_seen=self._signal is not None)
        if nonfinite:
            self._diverged(args, state, control, "non-finite training loss")
        elif self.watch.is_spike(loss):
            self._diverged(args, state, control, f"loss spike {loss:.4g} (running average {self.watch.ema:.4g})")
        elif signal_seen:
            name = signal.Signals(self._signal).name if self._signal else "a signal"
            control.should_save = True
            self._stop(control, StopRequest("preempted", state.global_step, name, exit_code=self.exit_code))
        self._mark_plain_trainer_save(args, state, control)
        return control

    def _mark_plain_trainer_save(self, args, state, control) -> None:
        """A plain Trainer is about to write `checkpoint-N`: the marker goes in before its first byte, and a step
        whose checkpoint is already complete is not written again (`LLMKitTrainer._save_checkpoint` does both)."""
        if not control.should_save or isinstance(control, RequestingControl):
            return
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if checkpoint.is_dir() and classify_checkpoint(checkpoint, checksums=False).resumable:
            control.should_save = False
        elif args.should_save or args.save_on_each_node or world_size() > 1:
            mark_writing(checkpoint)

    def on_save(self, args, state, control, model=None, **kwargs):
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if any_rank(self.check_weights_on_save and not self.watch.weights_finite(model), args.device):
            barrier()
            if state.is_world_process_zero:
                remove_checkpoint(checkpoint)  # ours, never completed
            self._diverged(args, state, control, "non-finite weights at save time")
            return control
        barrier()  # every rank has finished writing its part
        if state.is_world_process_zero and checkpoint.is_dir():
            verdict = classify_checkpoint(checkpoint, checksums=False)
            if verdict.state is not CheckpointState.COMPLETE:  # not yet listed (a re-save is skipped earlier)
                save_with_retries(
                    lambda: write_manifest(
                        checkpoint, checksum=self.checksum, fsync=self.fsync, extra={"world_size": args.world_size}
                    ),
                    retries=self.manifest_retries,
                    delay=0.5,
                    what=f"manifest of {checkpoint.name}",
                    collective=False,  # only the main process writes the manifest
                )
            rotate_checkpoints(args.output_dir, args.save_total_limit, keep=(state.best_model_checkpoint,))
            drop_abandoned(args.output_dir)
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        request = getattr(control, "stop_request", None)
        if request is not None and request.kind != "preempted":
            control.should_save = False  # never save the diverged state, even at an epoch-end save
        self._mark_plain_trainer_save(args, state, control)
        self._raise_pending(args, state)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
        self._raise_pending(args, state)
        return control


def preemption_message(request: StopRequest, output_dir: str) -> str:
    """The one line a preempted run ends with: what happened, where the checkpoint is, how to continue."""
    checkpoint = Path(output_dir) / f"checkpoint-{request.step}"
    return (
        f"received {request.reason}: stopped at step {request.step} after saving the complete checkpoint "
        f"{checkpoint}; run the same command again to continue from it"
    )
