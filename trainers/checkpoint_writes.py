"""How `LLMKitTrainer` writes a checkpoint and the final model folder.

A checkpoint write (`save_checkpoint`, called from `_save_checkpoint`) is this trainer's part of the checkpoint's
transaction (`hf_llmkit.checkpoints.transaction`):

1. It begins the transaction (or joins the one a `CheckpointGuard` began when the Trainer was about to save): a
   step whose `checkpoint-N` already loads is not written again; a leftover folder is cleared; every rank marks it.
2. The Trainer writes (part `trainer`), with its own `save_total_limit` rotation held off (it runs before the
   checkpoint is complete and counts incomplete folders); transient I/O errors are retried on every rank together;
   the run record (`llmkit_run.json`, part `run identity`) is written next to the Trainer's files.
3. It finishes its part. The last party to finish completes the checkpoint: the guard's `on_save` when the trainer
   has one (manifest), else this call (marker removed); the attached part writers (`SavePeftModelCallback`) write
   first, rotation follows.

A disk-full or permission error ends the run with `CheckpointWriteError`: one line saying so; the half-written
folder (ours) is removed and the last complete checkpoint is left as it was.

The final model folder (`save_model`) is marked while it is written and gets a manifest of the files the save wrote.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path

from hf_llmkit.checkpoints.collectives import barrier
from hf_llmkit.checkpoints.endings import CheckpointWriteError, logged
from hf_llmkit.checkpoints.lifecycle import CheckpointGuard
from hf_llmkit.checkpoints.manifest import mark_writing, payload_files, write_manifest
from hf_llmkit.checkpoints.names import MODEL_FILE_PATTERNS, checkpoint_folder
from hf_llmkit.checkpoints.retries import describe_write_error, save_with_retries
from hf_llmkit.checkpoints.transaction import GUARD, WRITER, begin_save
from hf_llmkit.compat.transformers import saved_callback_state
from hf_llmkit.trainers.run_identity import RUN_IDENTITY_PART, write_run_identity

logger = logging.getLogger(__name__)

__all__ = ["MODEL_FILE_PATTERNS", "save_checkpoint", "save_final_model"]


@contextmanager
def _trainer_rotation_held_off(args):
    limit, args.save_total_limit = args.save_total_limit, None
    try:
        yield limit
    finally:
        args.save_total_limit = limit


def save_checkpoint(trainer, write: Callable[[], None], identity: dict | None) -> None:
    """Write `checkpoint-{global_step}` through `write()` (the Trainer's `_save_checkpoint`) as described above."""
    args, state = trainer.args, trainer.state
    folder = checkpoint_folder(args.output_dir, state.global_step)
    main = args.should_save
    txn = begin_save(folder, participant=WRITER, main=main, device=args.device)
    if not txn.is_open:
        logger.info("%s already holds this step's checkpoint; not writing it again", folder)
        return
    if any(isinstance(cb, CheckpointGuard) for cb in trainer.callback_handler.callbacks):
        txn.join(GUARD)  # the guard's on_save completes it (also a save it did not announce)
    _register_stateful_callbacks(trainer)

    def attempt() -> None:
        with txn.part(WRITER):
            write()
        if main and identity is not None:
            with txn.part(RUN_IDENTITY_PART):
                write_run_identity(identity, folder)

    try:
        with _trainer_rotation_held_off(args) as limit:
            save_with_retries(
                attempt,
                retries=getattr(args, "save_retries", 0),
                delay=getattr(args, "save_retry_delay", 1.0),
                device=args.device,
                what=f"checkpoint at step {state.global_step}",
            )
    except Exception as err:
        reason = describe_write_error(err, folder)
        if reason is None:
            raise
        txn.abandon()  # ours and never completed; frees what it took
        message = f"could not write {folder}: {reason}; the last complete checkpoint is untouched"
        raise logged(CheckpointWriteError(message), is_main_process=main) from err
    txn.finish(
        WRITER,
        output_dir=args.output_dir,
        save_total_limit=limit,
        keep=(state.best_model_checkpoint,),
        model=trainer.model,
        processing_class=trainer.processing_class,
    )


def _register_stateful_callbacks(trainer) -> None:
    """Give every `ExportableState` callback (and the control) an entry in `state.stateful_callbacks`.

    Resumed from a checkpoint saved without one of them (a plain Trainer's, or before a callback was added), the
    Trainer's save fails with a KeyError on the missing entry (transformers 5.23).
    """
    from transformers.trainer_callback import ExportableState

    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(callback, ExportableState):
            saved_callback_state(trainer.state, type(callback).__name__, callback.state())


def _snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    if not folder.is_dir():
        return {}
    return {p.name: (st.st_mtime_ns, st.st_size, st.st_ino) for p in folder.iterdir() if (st := _stat(p))}


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat() if path.is_file() and not path.is_symlink() else None
    except OSError:
        return None


def save_final_model(trainer, save: Callable[[], None], output_dir: str) -> None:
    """`save()` (the Trainer's `save_model`) into `output_dir`, marked while it runs, then given a manifest."""
    folder = Path(output_dir)
    main = trainer.args.should_save
    before = _snapshot(folder) if main else {}
    if main:
        mark_writing(folder)
    try:
        save()
    except Exception as err:
        reason = describe_write_error(err, folder)
        if reason is None:
            raise
        message = f"could not write the final model into {folder}: {reason}; the checkpoints are untouched"
        raise logged(CheckpointWriteError(message), is_main_process=main) from err
    barrier()
    if not main:
        return
    after = _snapshot(folder)
    written = [
        name
        for name in sorted(after)
        if after[name] != before.get(name) or any(fnmatch(name, pattern) for pattern in MODEL_FILE_PATTERNS)
    ]
    payload = {p.name for p in payload_files(folder, recursive=False)}
    write_manifest(folder, files=[name for name in written if name in payload])
