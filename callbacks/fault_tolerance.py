"""`FaultToleranceCallback`: checkpoints that survive kills, clean preemption, and rollback on NaN/spiking loss.

It works the same under every Trainer (`transformers.Trainer`, TRL's `SFTTrainer`, any subclass, `LLMKitTrainer`):

- **Complete checkpoints.** Every writer marks a checkpoint before its first byte; after every save, once all ranks
  have finished writing, the main process writes a manifest (files, sizes, checksums) into it, last, and only then
  does the checkpoint count; then `save_total_limit` is applied on the classifier's terms (never deleting the newest
  complete checkpoint). Resume, rotation and verification share one classifier (`hf_llmkit.checkpoints.status`):
  only our own interrupted writes are ever deleted unasked, corrupt checkpoints are moved aside, checkpoints without
  a manifest (written without this callback) are validated by loading and resumed from.
- **Preemption.** SIGTERM / SIGUSR1 make every rank save at the next step boundary and stop. The run then ends with
  `TrainingInterrupted`, exit status 143 by default (`exit_code`, or `LLMKitTrainingArguments.preemption_exit_code`):
  a preempted run is not a finished one, and re-running the same command continues it. The handlers are installed
  at `on_train_begin` and the ones they replaced are put back when training ends, in reverse order; where another
  component has installed its own handler over ours meanwhile, that one stays, and ours, if it is still called,
  passes the signal on to the handler it had replaced (so after `train()` a SIGTERM ends the process as before).
  transformers' own `TrainingArguments(enable_jit_checkpoint=True)` also saves on SIGTERM: together with this
  callback listening to SIGTERM the run is refused in one line before any work (one of them would silently not
  save); `FaultToleranceCallback(signals=("SIGUSR1",))` leaves SIGTERM to it. A checkpoint its save left half
  written (`checkpoint-is-incomplete.txt`) is an interrupted one: never resumed from, deleted.
- **Divergence.** A NaN/Inf training loss, a loss above `loss_spike_factor` x its running average, or non-finite
  weights at save time stop the run (`TrainingDivergedError`, exit status 3) naming the last complete checkpoint;
  `LLMKitTrainer` then rolls back to it by itself and skips the data since then, at most `max_rollbacks` times. The
  rollback count and the loss average are `ExportableState` attributes: they survive a resume.

The callback asks through `control` and ends a stopped run by raising, once the step's saves are done. With a
Trainer other than `LLMKitTrainer`, the Trainer's own `save_total_limit` rotation runs before the manifest exists:
keep `save_total_limit` at 2 or more (or unset) so a complete checkpoint exists at every moment.

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

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from hf_llmkit.checkpoints.collectives import any_rank, barrier
from hf_llmkit.checkpoints.endings import ResumeError, StopRequest, TrainingDivergedError, TrainingInterrupted, logged
from hf_llmkit.checkpoints.exit_codes import EXIT_DIVERGED, EXIT_PREEMPTED
from hf_llmkit.checkpoints.housekeeping import tidy_above_latest, tidy_checkpoints
from hf_llmkit.checkpoints.lifecycle import CheckpointGuard, ManifestSettings
from hf_llmkit.checkpoints.lock import OutputDirLock, hold_output_dir
from hf_llmkit.checkpoints.loss_watch import LossWatch
from hf_llmkit.checkpoints.names import checkpoint_folder
from hf_llmkit.checkpoints.preemption import PreemptionSignals, preemption_message
from hf_llmkit.checkpoints.status import classify_checkpoint, latest_complete_checkpoint
from hf_llmkit.checkpoints.transaction import GUARD, begin_save, close_run, transaction_of
from hf_llmkit.compat.transformers import saved_callback_state

logger = logging.getLogger(__name__)


class FaultToleranceCallback(TrainerCallback, ExportableState, CheckpointGuard):
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
        self.preemption = PreemptionSignals(signals)  # validates the names first
        if exit_code is not None and not 0 <= exit_code <= 255:
            raise ValueError(f"exit_code must be in 0..255 (or None for the trainer's default), got {exit_code}")
        if max_rollbacks < 0:
            raise ValueError(f"max_rollbacks must be >= 0 (0 disables rollback), got {max_rollbacks}")
        if manifest_retries < 0:
            raise ValueError(f"manifest_retries must be >= 0, got {manifest_retries}")
        self.checksum, self.fsync, self.exit_code = checksum, fsync, exit_code
        self.signal_names, self.signals = self.preemption.names, self.preemption.signals
        self.max_rollbacks, self.manifest_retries = max_rollbacks, manifest_retries
        self.check_weights_on_save = check_weights_on_save
        self.watch = LossWatch(
            spike_factor=loss_spike_factor, warmup_steps=loss_spike_warmup_steps, ema_decay=loss_ema_decay
        )
        self.rollbacks = 0  # resumable state (see `state`)
        self._pending: StopRequest | None = None  # raised once the step's saves are done
        self._lock: tuple[str, OutputDirLock] | None = None  # (output_dir, this run's share of its lock)

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

    def _restore(self, saved) -> None:
        """Apply the attributes saved for this callback in a checkpoint (its constructor arguments stay as given)."""
        saved = saved[0] if isinstance(saved, list) and saved else saved
        attributes = saved.get("attributes") if isinstance(saved, dict) else None
        for name, value in (attributes or {}).items():
            if name in ("rollbacks", "loss_ema", "good_steps"):
                setattr(self, name, value)

    @property
    def manifest_settings(self) -> ManifestSettings:
        return ManifestSettings(checksum=self.checksum, fsync=self.fsync, retries=self.manifest_retries)

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

    # -- signals (`hf_llmkit.checkpoints.preemption`) --------------------------------------------------------
    def _refuse_jit_checkpoint(self, args, state) -> None:
        """transformers' JIT checkpoint and this callback cannot both own SIGTERM: refuse before any work."""
        if getattr(args, "enable_jit_checkpoint", False) and signal.SIGTERM in self.signals:
            error = ResumeError(
                "enable_jit_checkpoint=True (transformers' SIGTERM checkpoint) and FaultToleranceCallback (which "
                "saves on SIGTERM too) would both handle SIGTERM: drop enable_jit_checkpoint, or pass "
                "FaultToleranceCallback(signals=('SIGUSR1',)) to leave SIGTERM to the JIT checkpoint"
            )
            raise logged(error, is_main_process=state.is_world_process_zero)

    def close(self) -> None:
        """Restore the signal handlers and remove the loss hook. Runs at `on_train_end`; `LLMKitTrainer` also calls
        it when training ends with an exception."""
        self.preemption.restore()
        self.watch.detach()
        if self._lock is not None:
            close_run(self._lock[0])  # a transaction left open by an exception is over

    # -- requests -------------------------------------------------------------------------------------------
    def _stop(self, control, request: StopRequest) -> None:
        """Stop after this step's saves (a preemption saves first); the first request wins."""
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
        self._stop(control, StopRequest("rollback", step, reason, checkpoint=checkpoint, rollbacks=self.rollbacks))

    def _raise_pending(self, args, state) -> None:
        """End a stopped run: the error carries the request (`LLMKitTrainer` catches a rollback and restarts)."""
        request, self._pending = self._pending, None
        if request is None:
            return
        self.close()
        main = state.is_world_process_zero
        if request.kind == "preempted":
            code = request.exit_code
            code = getattr(args, "preemption_exit_code", EXIT_PREEMPTED) if code is None else code
            message = f"{preemption_message(request, args.output_dir)} (exit status {code})"
            error = TrainingInterrupted(message, exit_code=code, request=request)
            raise logged(error, is_main_process=main, level=logging.WARNING)
        code = getattr(args, "divergence_exit_code", EXIT_DIVERGED)
        if request.kind == "rollback":
            message = (
                f"{request.reason} at step {request.step}: the run restarts from {request.checkpoint}, its last "
                "complete checkpoint (hf_llmkit.trainers.LLMKitTrainer rolls back by itself; with another Trainer, "
                "resume from it with a lower learning rate)"
            )
            error = TrainingDivergedError(message, exit_code=code, request=request)
            raise logged(error, is_main_process=main, level=logging.WARNING)
        error = TrainingDivergedError(f"training diverged: {request.reason}", exit_code=code, request=request)
        raise logged(error, is_main_process=main)

    # -- the output folder ----------------------------------------------------------------------------------
    def _hold_output_dir(self, args, state) -> bool:
        """This run's lock on `output_dir` (one run per folder), kept while the callback lives; True when taken
        just now. Raises `OutputDirInUse` (every rank) when another live run holds it."""
        if self._lock is not None and self._lock[0] == args.output_dir:
            return False
        try:
            handle = hold_output_dir(args.output_dir, main=state.is_world_process_zero, device=args.device)
        except ResumeError as err:
            raise logged(err, is_main_process=state.is_world_process_zero) from None
        self._lock = (args.output_dir, handle)
        return True

    def _refuse_unusable_resume(self, args, state) -> None:
        """The Trainer resumed from `checkpoint-{global_step}` of `output_dir`: refuse it unless it can be resumed
        from (a folder given explicitly and half written, say), naming the latest complete one."""
        checkpoint = checkpoint_folder(args.output_dir, state.global_step)
        if state.global_step == 0 or not checkpoint.is_dir():
            return
        verdict = classify_checkpoint(checkpoint, checksums=False)
        if verdict.resumable:
            return
        latest = latest_complete_checkpoint(args.output_dir)
        hint = f"resume from {latest}, the latest complete checkpoint" if latest else "train from scratch"
        error = ResumeError(
            f"the Trainer resumed from {verdict.describe()}; {hint} "
            "(resume_from_checkpoint=hf_llmkit.checkpoints.latest_complete_checkpoint(output_dir))"
        )
        raise logged(error, is_main_process=state.is_world_process_zero)

    # -- Trainer events -------------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        """Before anything is loaded: refuse a second SIGTERM handler, take the output folder, and leave no
        half-written checkpoint at its top, where `resume_from_checkpoint=True` (the highest `checkpoint-N`) would
        pick it."""
        self._refuse_jit_checkpoint(args, state)
        self._hold_output_dir(args, state)
        if state.is_world_process_zero:
            report = tidy_above_latest(args.output_dir)
            if report.deleted or report.corrupt or report.incomplete:
                latest = latest_complete_checkpoint(args.output_dir, checksums=False)
                logger.warning("the latest checkpoint that can be resumed from in %s: %s", args.output_dir, latest)
        barrier()
        return control

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._refuse_jit_checkpoint(args, state)  # added after the Trainer was built: no on_init_end
        self._hold_output_dir(args, state)
        self._refuse_unusable_resume(args, state)
        name = type(self).__name__
        # Resumed from a checkpoint saved without this callback, the Trainer's save would fail with KeyError on
        # the missing `stateful_callbacks` entry (transformers 5.23): give it one. Resumed from one saved with it,
        # the entry holds this callback's saved attributes (rollback count, loss average): restore them.
        self._restore(saved_callback_state(state, name, self.state()))
        self.preemption.received, self._pending = None, None
        self.preemption.install()
        self.watch.attach(model)
        if state.is_world_process_zero:  # checkpoints newer than the resume point must not be taken for this run's
            tidy_checkpoints(args.output_dir, resume_step=state.global_step)
        barrier()

    def on_step_end(self, args, state, control, **kwargs):
        received = self.preemption.received
        signal_seen, nonfinite, loss = self.watch.verdict(args.device, signal_seen=received is not None)
        if nonfinite:
            self._diverged(args, state, control, "non-finite training loss")
        elif self.watch.is_spike(loss):
            self._diverged(args, state, control, f"loss spike {loss:.4g} (running average {self.watch.ema:.4g})")
        elif signal_seen:
            name = signal.Signals(received).name if received else "a signal"
            control.should_save = True
            self._stop(control, StopRequest("preempted", state.global_step, name, exit_code=self.exit_code))
        self._begin_save(args, state, control)
        return control

    def _begin_save(self, args, state, control) -> None:
        """The Trainer is about to write `checkpoint-N`: its transaction begins (the marker goes in before the first
        byte), and a step whose checkpoint already loads is not written again."""
        if control.should_save:
            txn = self._begin(args, state, marked=True)
            control.should_save = txn.is_open

    def _begin(self, args, state, *, marked: bool):
        checkpoint = checkpoint_folder(args.output_dir, state.global_step)
        return begin_save(checkpoint, participant=GUARD, main=args.should_save, device=args.device, marked=marked)

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        """The checkpoint's files are written: refuse non-finite weights, else complete its transaction (its part
        writers, then the manifest, then rotation)."""
        txn = transaction_of(checkpoint_folder(args.output_dir, state.global_step))
        if txn is None or txn.state == "complete":  # a save nobody announced (save_strategy="best"): complete it
            txn = self._begin(args, state, marked=False)
        if not txn.is_open:
            return control
        txn.join(GUARD)
        if any_rank(self.check_weights_on_save and not self.watch.weights_finite(model), args.device):
            txn.abandon()  # ours, never completed
            self._diverged(args, state, control, "non-finite weights at save time")
            return control
        txn.finish(
            GUARD,
            output_dir=args.output_dir,
            save_total_limit=args.save_total_limit,
            keep=(state.best_model_checkpoint,),
            manifest=self.manifest_settings,
            extra={"world_size": args.world_size},
            model=model,
            processing_class=processing_class,
        )
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if self._pending is not None and self._pending.kind != "preempted":
            control.should_save = False  # never save the diverged state, even at an epoch-end save
        self._begin_save(args, state, control)
        self._raise_pending(args, state)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
        self._raise_pending(args, state)
        return control
