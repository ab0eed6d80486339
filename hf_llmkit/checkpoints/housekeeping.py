"""What may happen to checkpoint folders: deleting ours, moving the rest aside, rotation. Nothing else.

Every decision comes from `classify_checkpoint` (hf_llmkit.checkpoints.status):

- only an `interrupted` folder (our marker or the Trainer's just-in-time one, no manifest) is deleted without being
  asked to;
- a `corrupt` one is renamed `corrupt-checkpoint-N` and kept, with the reason logged;
- at the start of a run, resumable checkpoints *newer* than the resume point (an explicit older
  `resume_from_checkpoint`, or a fresh start into a used folder) are renamed `abandoned-checkpoint-N`: kept until
  the run has written a complete checkpoint of its own (`drop_abandoned`), so a kill before that loses nothing;
- `rotate_checkpoints` applies `save_total_limit` to resumable checkpoints and never deletes the newest one.

Nothing here follows a symlink: a `checkpoint-N` that is a symlink, or a folder outside `output_dir`, is never
deleted or renamed. The prefixes of renamed folders keep them out of `checkpoint-*` globs (the plain Trainer's own
rotation, `get_last_checkpoint`).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from hf_llmkit.checkpoints.manifest import mark_writing
from hf_llmkit.checkpoints.names import (
    ABANDONED_PREFIX,
    CHECKPOINT_PREFIX,
    CORRUPT_PREFIX,
    INCOMPLETE_PREFIX,
    MANIFEST_NAME,
    WRITING_MARKER,
    checkpoint_step,
    list_checkpoints,
)
from hf_llmkit.checkpoints.status import CheckpointState, classify_checkpoint

logger = logging.getLogger(__name__)

__all__ = [
    "TidyReport",
    "drop_abandoned",
    "move_aside",
    "remove_checkpoint",
    "rotate_checkpoints",
    "tidy_above_latest",
    "tidy_checkpoints",
]


def _owned(folder: Path) -> bool:
    """A real folder directly inside its parent (never a symlink, so nothing outside output_dir is touched)."""
    return not folder.is_symlink() and folder.is_dir()


def remove_checkpoint(folder: str | os.PathLike) -> bool:
    """Delete a checkpoint folder, manifest first (a cut-short deletion never leaves a 'complete' fragment).

    Refuses symlinks (returns False): deletion never follows a link out of the output folder.
    """
    folder = Path(folder)
    if not _owned(folder):
        if folder.is_symlink():
            logger.warning("not deleting %s: it is a symlink", folder)
        return False
    # Marked as ours-being-written first, so a deletion cut short leaves an `interrupted` folder that the next
    # run finishes deleting (never a fragment that looks complete, or foreign).
    mark_writing(folder)
    (folder / MANIFEST_NAME).unlink(missing_ok=True)
    for child in folder.iterdir():
        if child.name == WRITING_MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)  # rmtree removes links inside, never their targets
        else:
            child.unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    return True


def move_aside(folder: str | os.PathLike, prefix: str) -> Path | None:
    """Rename `folder` (or a stray file) to `<prefix><name>` (`-2`, `-3`... if taken); None for a symlink."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.exists():
        return None
    target, n = folder.with_name(prefix + folder.name), 2
    while target.exists() or target.is_symlink():
        target, n = folder.with_name(f"{prefix}{folder.name}-{n}"), n + 1
    os.rename(folder, target)
    return target


@dataclass
class TidyReport:
    """What `tidy_checkpoints` did (names before the move)."""

    deleted: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)


def tidy_checkpoints(output_dir: str | os.PathLike, *, resume_step: int) -> TidyReport:
    """Before training writes into `output_dir`: clear the way for a run that starts at `resume_step`.

    Interrupted writes of ours are deleted; corrupt checkpoints are moved aside (`corrupt-`); checkpoints newer
    than `resume_step` would be overwritten by this run, so resumable ones become `abandoned-` and the others
    `incomplete-`. Older checkpoints without a manifest that do not load are left where they are. Main process
    only; the other ranks must wait for it.
    """
    report = TidyReport()
    for checkpoint in list_checkpoints(output_dir):
        newer = (checkpoint_step(checkpoint) or 0) > resume_step
        verdict = classify_checkpoint(checkpoint, checksums=newer)  # older ones: sizes suffice to find a mismatch
        if verdict.state is CheckpointState.INTERRUPTED:
            if remove_checkpoint(checkpoint):
                report.deleted.append(checkpoint.name)
                logger.info("deleted %s: %s", checkpoint, verdict.reason)
        elif verdict.state is CheckpointState.CORRUPT:
            _move(checkpoint, CORRUPT_PREFIX, report.corrupt, f"its manifest does not match: {verdict.reason}")
        elif newer and verdict.resumable:
            _move(
                checkpoint,
                ABANDONED_PREFIX,
                report.abandoned,
                f"it is newer than the resume point (step {resume_step}); kept until this run writes a complete "
                "checkpoint",
            )
        elif newer:
            _move(checkpoint, INCOMPLETE_PREFIX, report.incomplete, str(verdict.reason))
    return report


def tidy_above_latest(output_dir: str | os.PathLike) -> TidyReport:
    """Main process: make the highest `checkpoint-N` one that can be resumed from (or leave none).

    What picks "the highest checkpoint" (`resume_from_checkpoint=True` of a Trainer, transformers'
    `get_last_checkpoint`) would otherwise take a half-written one. Every checkpoint newer than the newest resumable
    one is deleted when it is our interrupted write, else moved aside (`corrupt-` / `incomplete-`). Sizes only: the
    checksums of a large checkpoint are read once, when a run resumes from it.
    """
    report = TidyReport()
    for checkpoint in reversed(list_checkpoints(output_dir)):
        verdict = classify_checkpoint(checkpoint, checksums=False)
        if verdict.resumable:
            break
        if verdict.state is CheckpointState.INTERRUPTED:
            if remove_checkpoint(checkpoint):
                report.deleted.append(checkpoint.name)
                logger.warning("deleted %s: %s", checkpoint, verdict.reason)
            continue
        prefix, record = (
            (CORRUPT_PREFIX, report.corrupt) if verdict.state is CheckpointState.CORRUPT else
            (INCOMPLETE_PREFIX, report.incomplete)
        )  # fmt: skip
        _move(checkpoint, prefix, record, str(verdict.reason))
    return report


def _move(checkpoint: Path, prefix: str, record: list[str], why: str) -> None:
    target = move_aside(checkpoint, prefix)
    if target is None:
        logger.warning("leaving %s in place (a symlink): %s", checkpoint, why)
        return
    record.append(checkpoint.name)
    logger.warning("moved %s to %s: %s", checkpoint.name, target.name, why)


def drop_abandoned(output_dir: str | os.PathLike) -> list[str]:
    """Delete `abandoned-checkpoint-*` folders; call once this run has a complete checkpoint of its own."""
    root, dropped = Path(output_dir), []
    if not root.is_dir():
        return dropped
    for folder in sorted(root.glob(f"{ABANDONED_PREFIX}{CHECKPOINT_PREFIX}-*")):
        if remove_checkpoint(folder):
            dropped.append(folder.name)
            logger.info("deleted %s: this run has written a complete checkpoint", folder.name)
    return dropped


def rotate_checkpoints(
    output_dir: str | os.PathLike, save_total_limit: int | None, *, keep: tuple[str | os.PathLike | None, ...] = ()
) -> list[Path]:
    """Apply `save_total_limit` to resumable checkpoints; returns the folders deleted.

    Never deletes the newest resumable checkpoint nor any in `keep` (e.g. the best model). Interrupted writes
    older than the newest resumable checkpoint are deleted too; newer ones are left alone (a write may be in
    progress). Corrupt and incomplete checkpoints are never deleted.
    """
    verdicts = [classify_checkpoint(c, checksums=False) for c in list_checkpoints(output_dir)]
    resumable = [v.path for v in verdicts if v.resumable]
    if not resumable:
        return []
    newest_step = checkpoint_step(resumable[-1])
    protected = {resumable[-1].resolve(), *(Path(k).resolve() for k in keep if k)}
    doomed = [
        v.path
        for v in verdicts
        if v.state is CheckpointState.INTERRUPTED and (checkpoint_step(v.path) or 0) < newest_step
    ]
    if save_total_limit is not None and save_total_limit > 0:
        excess = len(resumable) - max(save_total_limit, 1)
        for checkpoint in resumable:
            if excess <= 0:
                break
            if checkpoint.resolve() not in protected and _owned(checkpoint):
                doomed.append(checkpoint)
                excess -= 1
    deleted = []
    for checkpoint in doomed:
        if remove_checkpoint(checkpoint):
            logger.info("deleted checkpoint %s (save_total_limit / interrupted write)", checkpoint)
            deleted.append(checkpoint)
    return deleted
