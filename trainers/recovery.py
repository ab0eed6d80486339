"""The training loop around `Trainer.train` that `LLMKitTrainer` runs: resume checks, rollbacks, how a run ends.

`run_training` does, in order:

1. takes the output folder (`hf_llmkit.checkpoints.lock`: one run per folder, for the length of the call), records
   what this run is (`run_identity`), checks that every machine of the run sees the output folder
   (`hf_llmkit.trainers.multi_node`), resolves the resume point (`auto_resume`, `True`, or a folder; on several
   ranks, rank 0's choice) and refuses, before any work, a checkpoint that cannot be resumed from or belongs to
   another run;
2. clears the way in `output_dir` (`prepare_output_dir`);
3. runs `Trainer.train`. A callback that stops the run raises once the step's saves are done, its `StopRequest`
   attached (`hf_llmkit.checkpoints.endings`): on a `"rollback"` request the run restarts from the last complete
   checkpoint with the offending data window skipped; any other ending propagates with its exit code.

A checkpoint resumed at `max_steps` finishes without training a step (`TrainingAlreadyComplete`, raised by
`LLMKitTrainer.training_step`): resumed mid-epoch, the Trainer would otherwise run one step past the end.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import TrainOutput

from hf_llmkit.checkpoints.collectives import barrier
from hf_llmkit.checkpoints.endings import RunEndingError, StopRequest, logged
from hf_llmkit.checkpoints.lifecycle import CheckpointGuard
from hf_llmkit.checkpoints.lock import hold_output_dir
from hf_llmkit.checkpoints.names import MANIFEST_NAME, ROLLBACK_PREFIX, TRAINER_STATE, checkpoint_step
from hf_llmkit.checkpoints.resume_rule import resumes_latest
from hf_llmkit.checkpoints.transaction import close_run
from hf_llmkit.compat.accelerate import unwrap_optimizer
from hf_llmkit.compat.transformers import add_saved_callback_states
from hf_llmkit.trainers.multi_node import agree_on_checkpoint, check_output_dir_sharing
from hf_llmkit.trainers.resume import prepare_output_dir, resolve_resume, resume_step
from hf_llmkit.trainers.run_identity import check_length, check_run_identity, run_identity

logger = logging.getLogger(__name__)

__all__ = ["TrainingAlreadyComplete", "prepare_rollback_checkpoint", "run_training"]


class TrainingAlreadyComplete(Exception):
    """Raised before the first step of a run resumed at `max_steps` (the Trainer would train one step too many)."""


def rollback_path(request: StopRequest, output_dir: str | os.PathLike) -> Path:
    """Where the restart point goes (not named `checkpoint-N`: never auto-resumed)."""
    return Path(output_dir) / f"{ROLLBACK_PREFIX}-{checkpoint_step(request.checkpoint)}-to-{request.step}"


def exported_callback_states(callbacks) -> dict[str, Any]:
    """`stateful_callbacks` as the Trainer saves them: each `ExportableState` callback's `state()`, by class name."""
    grouped: dict[str, list] = {}
    for callback in callbacks:
        if isinstance(callback, ExportableState):
            grouped.setdefault(type(callback).__name__, []).append(callback.state())
    return {name: states[0] if len(states) == 1 else states for name, states in grouped.items()}


def prepare_rollback_checkpoint(request: StopRequest, output_dir: str | os.PathLike, callbacks=()) -> str:
    """A resumable copy of the good checkpoint whose `trainer_state.json` says `request.step`.

    Resuming from it restores weights, optimizer, scheduler and RNG from the good checkpoint while the Trainer
    fast-forwards the data loader past the bad step, so the batches since the checkpoint (the offending window) are
    skipped and counted as steps without an update. The callbacks' saved states are their states now (`state()`,
    as the Trainer saves them: the rollback count included). Files are hard-linked (copied where links are
    impossible); the manifest is dropped (the copy's state file differs).
    """
    source, target = Path(request.checkpoint), rollback_path(request, output_dir)
    if target.exists():
        shutil.rmtree(target)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link)
    (target / MANIFEST_NAME).unlink(missing_ok=True)
    state_file = target / TRAINER_STATE
    state_file.unlink()  # a hard link: write a fresh file, never the good checkpoint's
    state = json.loads((source / TRAINER_STATE).read_text(encoding="utf-8"))
    state["global_step"] = request.step
    add_saved_callback_states(state, exported_callback_states(callbacks))
    state_file.write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")
    return str(target)


def _guards(trainer) -> list[CheckpointGuard]:
    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, CheckpointGuard)]


def _reset_for_retrain(trainer) -> None:
    """Let `Trainer.train` build its optimizer wrapper again; the states are reloaded from the checkpoint."""
    if trainer.optimizer is not None:  # accelerate's AcceleratedOptimizer: re-preparing would wrap it twice
        trainer.optimizer = unwrap_optimizer(trainer.optimizer)


def _finish_complete_run(trainer) -> TrainOutput:
    """The resumed checkpoint is the end of training: its weights are loaded, no step runs (no loss to report)."""
    logger.info("training already finished at step %d (resumed from its last checkpoint)", trainer.state.global_step)
    trainer.is_in_train = False
    trainer.control = trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)
    metrics = {"train_loss": None, "train_runtime": 0.0, "epoch": trainer.state.epoch}
    return TrainOutput(trainer.state.global_step, None, metrics)


def _say_what_the_loss_covers(output: TrainOutput, resumed_at: int) -> TrainOutput:
    """After a resume, `train_loss` averages this call's steps only: `train_loss_steps` says which ("7-8"; "none"
    when the checkpoint was the end of the run)."""
    if not resumed_at or not isinstance(output, TrainOutput):
        return output
    metrics = dict(output.metrics)
    ran = output.global_step > resumed_at
    metrics["train_loss_steps"] = f"{resumed_at + 1}-{output.global_step}" if ran else "none"
    return TrainOutput(output.global_step, output.training_loss, metrics)


def _resume_point(trainer, resume_from_checkpoint) -> str | None:
    """The checkpoint this call resumes from (None: from scratch), checked and with the way cleared for it."""
    args = trainer.args
    check_output_dir_sharing(args)  # several machines: one output folder they all see
    resume = resolve_resume(trainer, resume_from_checkpoint)
    if resumes_latest(resume_from_checkpoint, auto_resume=getattr(args, "auto_resume", False)):  # rank 0's choice
        resume = agree_on_checkpoint(args, resume, checksums=getattr(args, "resume_verify_checksums", True))
    if resume is not None:  # another run's checkpoint is refused; settings a resume may change take effect
        check_length(args.max_steps, resume_step(resume), resume, args.output_dir)
        trainer.changed_settings = check_run_identity(trainer.run_identity, resume, args.output_dir)
    prepare_output_dir(trainer, resume)
    return resume


def _train_with_rollbacks(trainer, train: Callable[..., Any], resume: str | None, **kwargs) -> Any:
    made: list[str] = []
    try:
        while True:
            try:
                return train(resume_from_checkpoint=resume, **kwargs)
            except TrainingAlreadyComplete:
                return _finish_complete_run(trainer)
            except RunEndingError as err:
                request = err.request
                if request is None or request.kind != "rollback":
                    raise
            if trainer.is_world_process_zero():
                prepare_rollback_checkpoint(request, trainer.args.output_dir, trainer.callback_handler.callbacks)
            barrier()
            resume = str(rollback_path(request, trainer.args.output_dir))
            made.append(resume)
            logger.warning(
                "rolling back to %s and skipping the data up to step %d (%s; rollback %d)", request.checkpoint,
                request.step, request.reason, request.rollbacks,
            )  # fmt: skip
            _reset_for_retrain(trainer)
    finally:
        if trainer.is_world_process_zero():
            for folder in made:
                shutil.rmtree(folder, ignore_errors=True)


def run_training(trainer, train: Callable[..., Any], resume_from_checkpoint=None, **kwargs) -> Any:
    """`train(resume_from_checkpoint=..., **kwargs)` with the checks, restarts and endings described above."""
    trainer.run_identity = run_identity(trainer)
    main, lock = trainer.is_world_process_zero(), None
    try:
        lock = hold_output_dir(trainer.args.output_dir, main=main, device=trainer.args.device)
        resume = _resume_point(trainer, resume_from_checkpoint)
        trainer.resumed_from = resume  # what this train() call started from (None: from scratch), for reports
        output = _train_with_rollbacks(trainer, train, resume, **kwargs)
        return _say_what_the_loss_covers(output, resume_step(resume))
    except RunEndingError as err:  # refused before any work, or e.g. a checkpoint that fails to load: one line, once
        raise logged(err, is_main_process=main) from err.__cause__
    finally:
        if lock is not None:
            lock.release()
        for guard in _guards(trainer):
            guard.close()  # signal handlers and hooks, also when training raised
        close_run(trainer.args.output_dir)  # no checkpoint transaction outlives the call
