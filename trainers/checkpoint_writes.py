"""How `LLMKitTrainer` writes a checkpoint and the final model folder.

A checkpoint write (`save_checkpoint`, called from `_save_checkpoint`):

1. A step whose `checkpoint-N` already loads is not written again (a same-step re-save would rewrite a complete
   checkpoint in place). A leftover `checkpoint-N` is deleted if it is our interrupted write, else moved aside
   (`hf_llmkit.checkpoints.lifecycle.clear_for_writing`).
2. Every rank creates the writing marker before its first byte (`begin_checkpoint`).
3. The Trainer writes, with its own `save_total_limit` rotation held off (it runs before the checkpoint is complete
   and counts incomplete folders); transient I/O errors are retried on every rank together, and the run record
   (`llmkit_run.json`) is written next to the Trainer's files.
4. The checkpoint is made complete once per save by `complete_checkpoint`: in the `on_save` of the trainer's
   `CheckpointGuard` (a `FaultToleranceCallback`: manifest, rotation), or here when it has none (marker removed,
   rotation).

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
from hf_llmkit.checkpoints.housekeeping import remove_checkpoint
from hf_llmkit.checkpoints.lifecycle import CheckpointGuard, begin_checkpoint, complete_checkpoint
from hf_llmkit.checkpoints.manifest import mark_writing, payload_files, write_manifest
from hf_llmkit.checkpoints.names import checkpoint_folder
from hf_llmkit.checkpoints.retries import describe_write_error, save_with_retries
from hf_llmkit.compat.transformers import saved_callback_state

logger = logging.getLogger(__name__)

__all__ = ["MODEL_FILE_PATTERNS", "save_checkpoint", "save_final_model"]

# What a model / tokenizer / processor save writes at the top of a folder (the final model's manifest lists these,
# plus anything the save created or changed, and never run outputs such as results or logs).
MODEL_FILE_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template.*",
    "preprocessor_config.json",
    "processor_config.json",
)


@contextmanager
def _trainer_rotation_held_off(args):
    limit, args.save_total_limit = args.save_total_limit, None
    try:
        yield limit
    finally:
        args.save_total_limit = limit


def save_checkpoint(trainer, write: Callable[[], None], identity: dict | None) -> None:
    """Write `checkpoint-{global_step}` through `write()` (the Trainer's `_save_checkpoint`) as described above."""
    from hf_llmkit.trainers.run_identity import write_run_identity

    args, state = trainer.args, trainer.state
    folder = checkpoint_folder(args.output_dir, state.global_step)
    main = args.should_save
    if not begin_checkpoint(folder, main=main, device=args.device):
        logger.info("%s already holds this step's checkpoint; not writing it again", folder)
        return
    _register_stateful_callbacks(trainer)

    def attempt() -> None:
        write()
        if main and identity is not None:
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
        barrier()
        if main:
            remove_checkpoint(folder)  # ours and never completed; frees what it took
        message = f"could not write {folder}: {reason}; the last complete checkpoint is untouched"
        raise logged(CheckpointWriteError(message), is_main_process=main) from err
    barrier()  # every rank's files are on disk
    guarded = any(isinstance(cb, CheckpointGuard) for cb in trainer.callback_handler.callbacks)
    if main and not guarded:  # else the guard's on_save completes it
        complete_checkpoint(
            folder, output_dir=args.output_dir, save_total_limit=limit, keep=(state.best_model_checkpoint,)
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
