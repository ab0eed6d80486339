"""The one rule for where a run resumes from; the Trainers and the main jobs ask it, nothing else decides.

- `resume_from_checkpoint=False`, or None without `auto_resume`: from scratch.
- `resume_from_checkpoint=True`, or None with `auto_resume`: the newest checkpoint of `output_dir` that can be
  resumed from (complete, or without a manifest but loading: `latest_complete_checkpoint`); with True, a folder
  without one is an error, with `auto_resume` it means from scratch.
- a folder: that checkpoint, which must be resumable, else a one-line `ResumeError` says what is wrong with it and
  which checkpoint would do.

A checkpoint saved with `save_only_model=True` holds no optimizer or scheduler state: resumed from, the optimizer
and the learning-rate schedule start over (the Trainer skips the missing files without a word). Given the run's
`save_only_model`, the rule says so: a run that saves model-only checkpoints itself resumes from one with a
one-line warning; a run that saves full checkpoints asks for an exact resumption, and is refused in one line.

    resolve_resume("outputs/run", None, auto_resume=True)   # "outputs/run/checkpoint-8", or None
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hf_llmkit.checkpoints.endings import ResumeError
from hf_llmkit.checkpoints.status import classify_checkpoint, holds_model_only, latest_complete_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["check_model_only", "resolve_resume", "resumes_latest", "will_resume"]


def resumes_latest(resume_from_checkpoint: str | bool | None, *, auto_resume: bool) -> bool:
    """Whether the run resumes from the newest resumable checkpoint of its output folder (not a given folder)."""
    return resume_from_checkpoint is True or (resume_from_checkpoint is None and bool(auto_resume))


def resolve_resume(
    output_dir: str | os.PathLike,
    resume_from_checkpoint: str | bool | None,
    *,
    auto_resume: bool = False,
    checksums: bool = True,
    save_only_model: bool | None = None,
) -> str | None:
    """The checkpoint a run into `output_dir` resumes from (None: from scratch); raises `ResumeError` on a bad one.
    `checksums`: the newest checkpoint must also pass its manifest's checksums. `save_only_model`: the run's own
    setting, which decides whether a model-only checkpoint is resumed (None: not checked)."""
    found = _resolve(output_dir, resume_from_checkpoint, auto_resume=auto_resume, checksums=checksums)
    if found is not None and save_only_model is not None:
        check_model_only(found, save_only_model=save_only_model)
    return found


def check_model_only(checkpoint: str, *, save_only_model: bool) -> None:
    """A model-only checkpoint: one warning line when the run saves model-only checkpoints itself, else refused."""
    if not holds_model_only(checkpoint):
        return
    if not save_only_model:
        raise ResumeError(
            f"{checkpoint} holds the model only (saved with save_only_model=True): the optimizer and the "
            "learning-rate schedule would restart fresh, not continue; resume with --save_only_model true to accept "
            "that, or from a checkpoint saved with the optimizer"
        )
    logger.warning(
        "resuming from %s, a model-only checkpoint (save_only_model=True): the optimizer and the learning-rate "
        "schedule restart fresh, not where the run stopped", checkpoint,
    )  # fmt: skip


def _resolve(output_dir, resume_from_checkpoint, *, auto_resume: bool, checksums: bool) -> str | None:
    if resumes_latest(resume_from_checkpoint, auto_resume=auto_resume):
        found = latest_complete_checkpoint(output_dir, checksums=checksums)
        if found is None and resume_from_checkpoint is True:
            raise ResumeError(
                f"no complete checkpoint in {output_dir}; train without resume_from_checkpoint=True, "
                "or pass the path of a checkpoint folder"
            )
        if found is not None:
            logger.info("resuming from the latest complete checkpoint %s", found)
        return found
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    return _checked_folder(str(resume_from_checkpoint), output_dir)


def will_resume(
    output_dir: str | os.PathLike, resume_from_checkpoint: str | bool | None, *, auto_resume: bool
) -> bool:
    """Whether a run will resume, asked before it starts: a given folder (checked when the run starts), or a
    resumable checkpoint in `output_dir` (sizes checked; the run's own lookup also checks checksums)."""
    if resume_from_checkpoint not in (None, True, False):
        return True
    return resolve_resume(output_dir, resume_from_checkpoint, auto_resume=auto_resume, checksums=False) is not None


def _checked_folder(folder: str, output_dir: str | os.PathLike) -> str:
    verdict = classify_checkpoint(folder)
    if verdict.resumable:
        return folder
    newest = latest_complete_checkpoint(output_dir) if Path(output_dir).is_dir() else None
    hint = f"resume from {newest} instead" if newest else "omit resume_from_checkpoint to start from scratch"
    what = "does not exist" if not Path(folder).exists() else f"is {verdict.state.value}: {verdict.reason}"
    raise ResumeError(f"resume_from_checkpoint {folder} {what}; {hint}")
