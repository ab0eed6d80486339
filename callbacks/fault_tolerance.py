"""`FaultToleranceCallback`: checkpoints that survive kills, clean preemption, and rollback on NaN/spiking loss.

- **Complete checkpoints.** After every save, once all ranks have finished writing, the main process writes a
  manifest (files, sizes, checksums) into the checkpoint, last; only then does the checkpoint count
  (`latest_complete_checkpoint`). The callback takes over `save_total_limit` rotation from the Trainer (whose
  rotation runs before the checkpoint is complete) and never deletes the newest complete checkpoint.
- **Preemption.** SIGTERM / SIGUSR1 make every rank save at the next step boundary and exit with `exit_code`,
  so a scheduler requeue or `torchrun --max-restarts` resumes from that checkpoint.
- **Divergence.** A NaN/Inf training loss, a loss above `loss_spike_factor` x its running average, or non-finite
  weights at save time roll training back to the last complete checkpoint and skip the data since then, at most
  `max_rollbacks` times, then stop with `TrainingDivergedError`. The in-process restart needs `LLMKitTrainer`;
  with a plain `Trainer` the callback stops with that error instead.

With `LLMKitTrainer`, transient I/O errors during a save are retried (`save_retries`) and `auto_resume=True`
resumes from the latest complete checkpoint, so re-running the same command continues the run.

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
    trainer = LLMKitTrainer(
        model=tiny_llama().train(), args=args, train_dataset=data, callbacks=[FaultToleranceCallback(exit_code=0)]
    )
    trainer.train()  # run it again after a kill: it resumes from the newest complete checkpoint
    ```
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hf_llmkit.callbacks.checkpoint_manifest import (
    latest_complete_checkpoint,
    list_checkpoints,
    remove_checkpoint,
    rotate_checkpoints,
    verify_checkpoint,
    write_manifest,
)
from hf_llmkit.callbacks.recovery import (
    RollbackRequest,
    TrainingAlreadyComplete,
    TrainingDivergedError,
    any_rank,
    save_with_retries,
)

logger = logging.getLogger(__name__)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class FaultToleranceCallback(TrainerCallback):
    """Makes a Trainer run survive kills, preemption and loss blow-ups (see the module docstring).

    Args:
        checksum: `hashlib` algorithm for the manifest checksums, or None to record sizes only.
        fsync: Flush checkpoint files and the manifest to stable storage before the checkpoint counts.
        signals: Signal names that request a save-and-exit at the next step boundary.
        exit_code: Process exit status after a signal-triggered save (pick what your requeue logic expects).
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
        signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1"),
        exit_code: int = 0,
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
        if not 0 <= exit_code <= 255:
            raise ValueError(f"exit_code must be in 0..255, got {exit_code}")
        if max_rollbacks < 0:
            raise ValueError(f"max_rollbacks must be >= 0 (0 disables rollback), got {max_rollbacks}")
        if loss_spike_factor is not None and loss_spike_factor <= 1.0:
            raise ValueError(f"loss_spike_factor must be > 1 (e.g. 3.0) or None, got {loss_spike_factor}")
        if not 0.0 < loss_ema_decay < 1.0:
            raise ValueError(f"loss_ema_decay must be in (0, 1), e.g. 0.9; got {loss_ema_decay}")
        if loss_spike_warmup_steps < 1 or manifest_retries < 0:
            raise ValueError("loss_spike_warmup_steps must be >= 1 and manifest_retries >= 0")
        self.checksum, self.fsync, self.exit_code = checksum, fsync, exit_code
        self.signals = tuple(getattr(signal, name) for name in signals)
        self.max_rollbacks, self.loss_spike_factor = max_rollbacks, loss_spike_factor
        self.loss_spike_warmup_steps, self.loss_ema_decay = loss_spike_warmup_steps, loss_ema_decay
        self.check_weights_on_save, self.manifest_retries = check_weights_on_save, manifest_retries
        self.recovery_supported = False  # set by LLMKitTrainer, which can restart training in-process
        self.pending_rollback: RollbackRequest | None = None
        self.rollbacks = 0
        self.preempted = False
        self._save_total_limit: int | None = None
        self._took_rotation = False
        self._signal: int | None = None
        self._old_handlers: dict[int, object] = {}
        self._hook = None
        self._losses: list[torch.Tensor] = []
        self._ema: float | None = None
        self._good_steps = 0

    # -- signals --------------------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if self._signal is None:
            logger.warning("received %s: saving at the next step boundary, then exiting", signal.Signals(signum).name)
        self._signal = signum

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("FaultToleranceCallback: not on the main thread, signal handlers not installed")
            return
        for signum in self.signals:
            if signum not in self._old_handlers:
                self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signals(self) -> None:
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers.clear()

    # -- loss watch -----------------------------------------------------------------------------------------
    def _capture_loss(self, module, inputs, output) -> None:
        if not module.training:
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach())

    def _step_verdict(self, args) -> tuple[bool, bool, float | None]:
        """(signal seen on any rank, loss non-finite on any rank, mean loss over ranks) for the step just done."""
        losses, self._losses = self._losses, []
        values = torch.stack([loss.float().reshape(()) for loss in losses]).tolist() if losses else []  # one sync
        nonfinite = sum(not math.isfinite(v) for v in values)
        stats = [float(self._signal is not None), float(nonfinite), 0.0, 0.0]
        if values and not nonfinite:
            stats[2:] = [sum(values) / len(values), 1.0]
        if _world_size() > 1:
            tensor = torch.tensor(stats, device=args.device)
            dist.all_reduce(tensor)  # one small collective per step: every rank must reach the same decision
            stats = tensor.tolist()
        signal_seen, nonfinite_ranks, loss_sum, finite_ranks = stats
        return signal_seen > 0, nonfinite_ranks > 0, (loss_sum / finite_ranks if finite_ranks else None)

    def _is_spike(self, loss: float | None) -> bool:
        if loss is None or self.loss_spike_factor is None:
            return False
        spike = self._good_steps >= self.loss_spike_warmup_steps and loss > self.loss_spike_factor * self._ema
        if not spike:
            self._ema = (
                loss if self._ema is None else self.loss_ema_decay * self._ema + (1 - self.loss_ema_decay) * loss
            )
            self._good_steps += 1
        return spike

    def _request_rollback(self, args, state, control, reason: str) -> None:
        control.should_save = False
        control.should_training_stop = True
        step = state.global_step
        if self.rollbacks >= self.max_rollbacks:
            raise TrainingDivergedError(
                f"{reason} at step {step}, and {self.rollbacks} rollback(s) already used (max_rollbacks="
                f"{self.max_rollbacks}); lower the learning rate, inspect the data before step {step}, or raise "
                "max_rollbacks"
            )
        checkpoint = latest_complete_checkpoint(args.output_dir)
        if checkpoint is None:
            raise TrainingDivergedError(
                f"{reason} at step {step} and no complete checkpoint in {args.output_dir} to roll back to; "
                "save more often (lower save_steps) or lower the learning rate"
            )
        self.rollbacks += 1
        self.pending_rollback = RollbackRequest(checkpoint=checkpoint, bad_step=step, reason=reason)
        logger.warning("%s at step %d: rolling back to %s (rollback %d)", reason, step, checkpoint, self.rollbacks)

    def take_rollback_request(self) -> RollbackRequest | None:
        """The pending rollback (consumed); `LLMKitTrainer` calls this after `train` returns."""
        request, self.pending_rollback = self.pending_rollback, None
        return request

    # -- Trainer events -------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not self._took_rotation:  # the Trainer would rotate before the manifest exists; we rotate after it
            self._save_total_limit, args.save_total_limit = args.save_total_limit, None
            self._took_rotation = True
        self._signal, self.preempted, self._losses = None, False, []
        self._install_signals()
        if model is not None and self._hook is None:
            self._hook = model.register_forward_hook(self._capture_loss)
        if state.is_world_process_zero:
            self._drop_superseded(args.output_dir, state.global_step)

    @staticmethod
    def _drop_superseded(output_dir: str, step: int) -> None:
        """Checkpoints newer than the resume point belong to an abandoned timeline (or a half-finished write)."""
        checkpoints = list_checkpoints(output_dir)
        if not any(verify_checkpoint(c, checksums=False) is None for c in checkpoints):
            return  # no manifests at all: not written by us, leave them alone
        for checkpoint in checkpoints:
            if int(checkpoint.name.rsplit("-", 1)[1]) > step:
                logger.info("removing %s: newer than the resume point (step %d)", checkpoint, step)
                remove_checkpoint(checkpoint)

    def on_step_begin(self, args, state, control, **kwargs):
        # Resumed from the final checkpoint of a run that stopped mid-epoch, the Trainer would run one more step
        # (and another at every re-run); LLMKitTrainer turns this into "already complete".
        if self.recovery_supported and 0 < state.max_steps <= state.global_step:
            raise TrainingAlreadyComplete()

    def on_step_end(self, args, state, control, **kwargs):
        signal_seen, nonfinite, loss = self._step_verdict(args)
        if nonfinite:
            self._request_rollback(args, state, control, "non-finite training loss")
        elif self._is_spike(loss):
            self._request_rollback(args, state, control, f"loss spike {loss:.4g} (running average {self._ema:.4g})")
        elif signal_seen:
            control.should_save = True
            control.should_training_stop = True
            self.preempted = True
        return control

    def _weights_finite(self, model) -> bool:
        if model is None or not self.check_weights_on_save:
            return True
        # One fp32-accumulated sum per tensor: NaN/Inf anywhere makes it non-finite (and it is far cheaper than
        # an elementwise isfinite over every weight).
        sums = [
            torch.sum(p.detach(), dtype=torch.float32) for p in model.parameters() if p.requires_grad and p.numel()
        ]
        return not sums or bool(torch.isfinite(torch.stack([s.cpu() for s in sums])).all())

    def on_save(self, args, state, control, model=None, **kwargs):
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if any_rank(not self._weights_finite(model), args.device):
            if state.is_world_process_zero:
                remove_checkpoint(checkpoint)
            self._request_rollback(args, state, control, "non-finite weights at save time")
            return control
        if _world_size() > 1:
            dist.barrier()  # every rank has finished writing its part
        if state.is_world_process_zero and checkpoint.is_dir():
            save_with_retries(
                lambda: write_manifest(
                    checkpoint, checksum=self.checksum, fsync=self.fsync, extra={"world_size": args.world_size}
                ),
                retries=self.manifest_retries,
                delay=0.5,
                what=f"manifest of {checkpoint.name}",
                collective=False,  # only the main process writes the manifest
            )
            rotate_checkpoints(args.output_dir, self._save_total_limit, keep=(state.best_model_checkpoint,))
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.pending_rollback is not None:
            control.should_save = False
        return control

    def release(self, args) -> None:
        """Restore the signal handlers and `save_total_limit`, remove the loss hook (also after an exception)."""
        self._restore_signals()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._took_rotation:
            args.save_total_limit, self._took_rotation = self._save_total_limit, False

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.pending_rollback is None or not self.recovery_supported:
            self.release(args)
        else:  # LLMKitTrainer restarts training right away: keep the rotation, drop the rest
            self._restore_signals()
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
        if self.pending_rollback is not None and not self.recovery_supported:
            request = self.pending_rollback
            raise TrainingDivergedError(
                f"{request.reason} at step {request.bad_step}; use hf_llmkit.trainers.LLMKitTrainer to roll back "
                f"automatically, or resume from {request.checkpoint} with a lower learning rate"
            )
        if self.preempted:
            logger.warning(
                "checkpoint saved at step %d after a signal; exiting with %d", state.global_step, self.exit_code
            )
            sys.exit(self.exit_code)
        return control
