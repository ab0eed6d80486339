"""How `LLMKitTrainer` writes a checkpoint and the final model folder.

A checkpoint write (`save_checkpoint`, called from `_save_checkpoint`):

1. A step whose `checkpoint-N` already loads is not written again (a same-step re-save would rewrite a complete
   checkpoint in place). A leftover `checkpoint-N` is deleted if it is our interrupted write, else moved aside.
2. Every rank creates the writing marker before its first byte.
3. The Trainer writes, with its own `save_total_limit` rotation held off (it runs before the checkpoint is complete
   and counts incomplete folders); transient I/O errors are retried on every rank together, and the run record
   (`llmkit_run.json`) is written next to the Trainer's files.
4. Once every rank is done the marker is removed (the checkpoint now loads; a `FaultToleranceCallback` adds the
   manifest in `on_save`), then rotation runs on the classifier's terms and `abandoned-` checkpoints go.

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

from hf_llmkit.checkpoints.collectives import any_rank, barrier
from hf_llmkit.checkpoints.endings import CheckpointWriteError, logged
from hf_llmkit.checkpoints.housekeeping import drop_abandoned, move_aside, remove_checkpoint, rotate_checkpoints
from hf_llmkit.checkpoints.manifest import clear_writing, mark_writing, payload_files, write_manifest
from hf_llmkit.checkpoints.names import CORRUPT_PREFIX, INCOMPLETE_PREFIX
from hf_llmkit.checkpoints.retries import describe_write_error, save_with_retries
from hf_llmkit.checkpoints.status import CheckpointState, classify_checkpoint

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


def _clear_the_way(folder: Path) -> bool:
    """Main process, before writing `folder`: False when it already holds a checkpoint that loads (skip the save)."""
    if not folder.exists() and not folder.is_symlink():
        return True
    verdict = classify_checkpoint(folder, checksums=False)
    if verdict.resumable:
        return False
    if folder.is_symlink():  # never write through a link out of output_dir: drop the link, keep its target
        folder.unlink()
        logger.warning("removed the link %s before writing this step's checkpoint (%s)", folder, verdict.reason)
    elif verdict.state is CheckpointState.INTERRUPTED:
        remove_checkpoint(folder)
    else:
        prefix = CORRUPT_PREFIX if verdict.state is CheckpointState.CORRUPT else INCOMPLETE_PREFIX
        target = move_aside(folder, prefix)
        logger.warning("moved %s aside to %s before writing it: %s", folder.name, target.name, verdict.reason)
    return True


def save_checkpoint(trainer, write: Callable[[], None], identity: dict | None) -> None:
    """Write `checkpoint-{global_step}` through `write()` (the Trainer's `_save_checkpoint`) as described above."""
    from hf_llmkit.trainers.run_identity import write_run_identity

    args, state = trainer.args, trainer.state
    folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
    main = args.should_save
    proceed = _clear_the_way(folder) if main else True
    if any_rank(not proceed, args.device):
        logger.info("%s already holds this step's checkpoint; not writing it again", folder)
        return
    barrier()  # the folder is cleared before any rank writes into it
    mark_writing(folder)
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
    if main:
        clear_writing(folder)
        rotate_checkpoints(args.output_dir, limit, keep=(state.best_model_checkpoint,))
        drop_abandoned(args.output_dir)


def _register_stateful_callbacks(trainer) -> None:
    """Give every `ExportableState` callback (and the control) an entry in `state.stateful_callbacks`.

    Resumed from a checkpoint saved without one of them (a plain Trainer's, or before a callback was added), the
    Trainer's save fails with a KeyError on the missing entry (transformers 5.23).
    """
    from transformers.trainer_callback import ExportableState

    stateful = trainer.state.stateful_callbacks
    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(callback, ExportableState):
            stateful.setdefault(type(callback).__name__, callback.state())


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
