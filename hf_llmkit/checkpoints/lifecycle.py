"""The two ends of a `checkpoint-N` write: the folder cleared and marked before its first byte, completed after
its last. Only `hf_llmkit.checkpoints.transaction` calls them (once per save, under any Trainer):

1. `begin_checkpoint(folder, ...)` (every rank together, before the first byte): a step whose checkpoint already
   loads is not written again; a leftover folder is deleted when it is our interrupted write, else moved aside (a
   symlink is removed, never written through); then every rank creates the writing marker.
2. `complete_checkpoint(...)` (main process, once every part is written): the manifest (or, without one, just the
   marker removed), then `save_total_limit` rotation on the classifier's terms, then the `abandoned-` checkpoints go.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_llmkit.checkpoints.collectives import any_rank, barrier
from hf_llmkit.checkpoints.housekeeping import drop_abandoned, move_aside, remove_checkpoint, rotate_checkpoints
from hf_llmkit.checkpoints.manifest import clear_writing, mark_writing, write_manifest
from hf_llmkit.checkpoints.names import CORRUPT_PREFIX, INCOMPLETE_PREFIX, WRITING_MARKER
from hf_llmkit.checkpoints.retries import save_with_retries
from hf_llmkit.checkpoints.status import CheckpointState, classify_checkpoint

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointGuard",
    "ManifestSettings",
    "begin_checkpoint",
    "clear_for_writing",
    "complete_checkpoint",
]


class CheckpointGuard:
    """A callback that takes part in every checkpoint transaction and completes it in its `on_save` (with a
    manifest), and may stop the run.

    A trainer that finds one among its callbacks leaves completion to it, and calls `close()` (signal handlers,
    hooks, the output folder's lock) when training ends with an exception.
    """

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


@dataclass(frozen=True)
class ManifestSettings:
    """How the manifest is written: `checksum` (a `hashlib` name, or None for sizes only), `fsync` (files and
    manifest on stable storage first), `retries` after a transient I/O error."""

    checksum: str | None = "sha256"
    fsync: bool = True
    retries: int = 3


def clear_for_writing(folder: str | os.PathLike) -> bool:
    """Main process, before writing `folder`: False when it already holds a checkpoint that loads (skip the save).

    A leftover symlink is removed (never written through), our interrupted write deleted (unless it holds nothing
    but the marker: begun for this very save), anything else moved aside.
    """
    folder = Path(folder)
    if not folder.exists() and not folder.is_symlink():
        return True
    verdict = classify_checkpoint(folder, checksums=False)
    if verdict.resumable:
        return False
    if verdict.state is CheckpointState.INTERRUPTED and not folder.is_symlink():
        if {p.name for p in folder.iterdir()} != {WRITING_MARKER}:
            remove_checkpoint(folder)
    elif folder.is_symlink():  # never write through a link out of output_dir: drop the link, keep its target
        folder.unlink()
        logger.warning("removed the link %s before writing this step's checkpoint (%s)", folder, verdict.reason)
    else:
        prefix = CORRUPT_PREFIX if verdict.state is CheckpointState.CORRUPT else INCOMPLETE_PREFIX
        target = move_aside(folder, prefix)
        logger.warning("moved %s aside to %s before writing it: %s", folder.name, target.name, verdict.reason)
    return True


def begin_checkpoint(folder: str | os.PathLike, *, main: bool, device: torch.device | str = "cpu") -> bool:
    """Every rank together, before the first byte of `folder`: False (on every rank) when it already holds a
    checkpoint that loads (skip the save); else the way is cleared (`main`) and every rank creates the writing
    marker (a kill from now on leaves an `interrupted` folder)."""
    proceed = clear_for_writing(folder) if main else True
    if any_rank(not proceed, device):
        return False
    barrier()  # the folder is cleared before any rank marks it
    mark_writing(folder)
    return True


def complete_checkpoint(
    folder: str | os.PathLike,
    *,
    output_dir: str | os.PathLike,
    save_total_limit: int | None,
    keep: Iterable[str | os.PathLike | None] = (),
    manifest: ManifestSettings | None = None,
    extra: dict | None = None,
) -> None:
    """Main process, once every writer of `folder` has finished: make it complete, then rotate.

    With `manifest`, the manifest is written last (retried on transient errors) unless the folder is already
    complete; without, the marker is removed (the checkpoint then counts as `unmanaged`: it loads). Then
    `save_total_limit` is applied (never to the newest resumable checkpoint nor to `keep`) and `abandoned-`
    checkpoints are deleted: this run has a complete checkpoint of its own.
    """
    folder = Path(folder)
    if folder.is_dir():
        if manifest is None:
            clear_writing(folder)
        elif classify_checkpoint(folder, checksums=False).state is not CheckpointState.COMPLETE:
            save_with_retries(
                lambda: write_manifest(folder, checksum=manifest.checksum, fsync=manifest.fsync, extra=extra),
                retries=manifest.retries,
                delay=0.5,
                what=f"manifest of {folder.name}",
                collective=False,  # only the main process writes the manifest
            )
    rotate_checkpoints(output_dir, save_total_limit, keep=tuple(keep))
    drop_abandoned(output_dir)
