"""Recovery mechanics shared by `FaultToleranceCallback` and `LLMKitTrainer`: retries, rollbacks, auto-resume.

A callback cannot re-run the Trainer's save or restart its loop, so the pieces that need the trainer live here
and `LLMKitTrainer` calls them from two documented hooks (`train` and `_save_checkpoint`):

- `save_with_retries` re-runs a checkpoint save that failed with a transient I/O error; every rank takes part in
  the decision so they retry (or give up) together.
- `train_with_recovery` resolves auto-resume to the latest *complete* checkpoint and, when a
  `FaultToleranceCallback` asks for a rollback (NaN/Inf or spiking loss), restarts training from the last good
  checkpoint with the offending data window skipped.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hf_llmkit.callbacks.checkpoint_manifest import checkpoint_step, latest_complete_checkpoint

logger = logging.getLogger(__name__)

ROLLBACK_PREFIX = "llmkit-rollback"
_PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG}


class TrainingDivergedError(RuntimeError):
    """The loss went NaN/Inf or spiked more often than `max_rollbacks` allows, or there was nothing to roll back to."""


class TrainingAlreadyComplete(Exception):
    """Raised before the first step of a run resumed at `max_steps` (the Trainer would train one step too many)."""


@dataclass
class RollbackRequest:
    """Restart from `checkpoint` as if steps up to `bad_step` had run: the data window in between is skipped."""

    checkpoint: str
    bad_step: int
    reason: str


def is_transient_io_error(err: BaseException) -> bool:
    """Whether a failed write is worth retrying (I/O errors, not permission or path mistakes)."""
    if isinstance(err, OSError):
        return err.errno not in _PERMANENT_ERRNOS
    text = str(err)
    # torch.save wraps write failures in RuntimeError; safetensors raises SafetensorError("... IoError ...").
    return ("PytorchStreamWriter" in text or "file write failed" in text) or (
        type(err).__name__ == "SafetensorError" and "IoError" in text
    )


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """True on every rank when `flag` is True on at least one (a no-op without a process group)."""
    if _world_size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def save_with_retries(
    save: Callable[[], Any],
    *,
    retries: int,
    delay: float,
    device: torch.device | str = "cpu",
    what: str = "save",
    collective: bool = True,
) -> None:
    """Run `save()`; on a transient I/O error on any rank, every rank runs it again (backoff `delay * 2**k`).

    With `collective` every rank must call this together (they agree on success); without it only this process
    retries (for writes only the main process makes).
    """
    for attempt in range(retries + 1):
        error: BaseException | None = None
        try:
            save()
        except Exception as err:
            if not is_transient_io_error(err):
                raise
            error = err
        failed = any_rank(error is not None, device) if collective else error is not None
        if not failed:
            if attempt:
                logger.warning("%s succeeded on attempt %d", what, attempt + 1)
            return
        if attempt == retries:
            if error is not None:
                raise error
            raise OSError(errno.EIO, f"{what} failed on another rank after {retries + 1} attempts")
        wait = delay * 2**attempt
        logger.warning(
            "%s failed (%s); retrying in %.1fs (%d/%d)", what, error or "another rank", wait, attempt + 1, retries
        )
        time.sleep(wait)


def rollback_path(request: RollbackRequest, output_dir: str | os.PathLike) -> Path:
    """Where `prepare_rollback_checkpoint` puts the restart point (not named `checkpoint-N`: never auto-resumed)."""
    return Path(output_dir) / f"{ROLLBACK_PREFIX}-{checkpoint_step(request.checkpoint)}-to-{request.bad_step}"


def prepare_rollback_checkpoint(request: RollbackRequest, output_dir: str | os.PathLike) -> str:
    """A resumable copy of the good checkpoint whose `trainer_state.json` says `bad_step`.

    Resuming from it restores weights, optimizer, scheduler and RNG from the good checkpoint while the Trainer
    fast-forwards the data loader past `bad_step`, so the batches since the checkpoint (the offending window) are
    skipped and counted as steps without an update. Files are hard-linked (copied where links are impossible).
    """
    source = Path(request.checkpoint)
    target = rollback_path(request, output_dir)
    if target.exists():
        shutil.rmtree(target)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link)
    state_file = target / "trainer_state.json"
    state_file.unlink()  # a hard link: rewrite a fresh file, never the good checkpoint's
    state = json.loads((source / "trainer_state.json").read_text(encoding="utf-8"))
    state["global_step"] = request.bad_step
    state_file.write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")
    return str(target)


def _reset_for_retrain(trainer) -> None:
    """Let `Trainer.train` build its optimizer wrapper again; the states are reloaded from the checkpoint."""
    inner = getattr(trainer.optimizer, "optimizer", None)
    if inner is not None:  # accelerate's AcceleratedOptimizer: re-preparing would wrap it twice
        trainer.optimizer = inner


def resolve_resume(trainer, resume_from_checkpoint: str | bool | None) -> str | None:
    """`True`, or None with `auto_resume`, means the latest complete checkpoint in `output_dir` (None if none)."""
    args = trainer.args
    if resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True or (resume_from_checkpoint is None and getattr(args, "auto_resume", False)):
        found = latest_complete_checkpoint(args.output_dir, checksums=getattr(args, "resume_verify_checksums", True))
        if found is None and resume_from_checkpoint is True:
            raise ValueError(
                f"no complete checkpoint in {args.output_dir}; train without resume_from_checkpoint=True, "
                "or pass the path of a checkpoint folder"
            )
        if found is not None:
            logger.info("resuming from the latest complete checkpoint %s", found)
        return found
    return resume_from_checkpoint


def _finish_complete_run(trainer):
    """The resumed checkpoint is the end of training: its weights are loaded, no step runs."""
    from transformers.trainer_utils import TrainOutput

    logger.info("training already finished at step %d (resumed from its last checkpoint)", trainer.state.global_step)
    trainer.is_in_train = False
    trainer.control = trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    train_loss = sum(losses) / len(losses) if losses else float("nan")
    return TrainOutput(trainer.state.global_step, train_loss, {"train_loss": train_loss, "train_runtime": 0.0})


def train_with_recovery(trainer, train: Callable[..., Any], resume_from_checkpoint=None, **kwargs) -> Any:
    """`train(resume_from_checkpoint=..., **kwargs)`, restarted from the last good checkpoint on a rollback request."""
    from hf_llmkit.callbacks.fault_tolerance import FaultToleranceCallback

    watchers = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, FaultToleranceCallback)]
    for watcher in watchers:
        watcher.recovery_supported = True
    resume = resolve_resume(trainer, resume_from_checkpoint)
    made: list[str] = []
    try:
        while True:
            try:
                output = train(resume_from_checkpoint=resume, **kwargs)
            except TrainingAlreadyComplete:
                return _finish_complete_run(trainer)
            request = next((w.take_rollback_request() for w in watchers if w.pending_rollback is not None), None)
            if request is None:
                return output
            if trainer.is_world_process_zero():
                prepare_rollback_checkpoint(request, trainer.args.output_dir)
            if _world_size() > 1:
                dist.barrier()
            resume = str(rollback_path(request, trainer.args.output_dir))
            made.append(resume)
            logger.warning(
                "rolling back to %s and skipping the data up to step %d (%s)",
                request.checkpoint,
                request.bad_step,
                request.reason,
            )
            _reset_for_retrain(trainer)
    finally:
        for watcher in watchers:
            watcher.release(trainer.args)
        if trainer.is_world_process_zero():
            for folder in made:
                shutil.rmtree(folder, ignore_errors=True)
