"""The one resume rule (`hf_llmkit.checkpoints.resume_rule`), asked by `LLMKitTrainer.train` and by the main jobs
before they start: a half-written newest checkpoint is never a resume (issue 34, 1)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from hf_llmkit.checkpoints.endings import ResumeError
from hf_llmkit.checkpoints.manifest import mark_writing, write_manifest
from hf_llmkit.checkpoints.names import TRAINER_STATE, checkpoint_folder
from hf_llmkit.checkpoints.resume_rule import resolve_resume, resumes_latest, will_resume
from tests.conftest import REPO


def _checkpoint(output_dir, step: int, *, complete: bool):
    """A real checkpoint folder: weights and state; with a manifest (complete) or left marked (a killed write)."""
    folder = checkpoint_folder(output_dir, step)
    mark_writing(folder)
    save_file({"w": torch.ones(2)}, folder / "model.safetensors")
    (folder / TRAINER_STATE).write_text(json.dumps({"global_step": step}))
    if complete:
        write_manifest(folder, fsync=False)
    return folder


@pytest.mark.parametrize(
    ("given", "auto", "latest"),
    [(None, False, False), (None, True, True), (True, False, True), (True, True, True), (False, True, False)],
)
def test_which_requests_mean_the_newest_checkpoint(given, auto, latest):
    assert resumes_latest(given, auto_resume=auto) is latest


def test_the_newest_resumable_checkpoint_not_the_newest_folder(tmp_path):
    _checkpoint(tmp_path, 2, complete=True)
    _checkpoint(tmp_path, 4, complete=False)  # killed mid-write: any `checkpoint-*` folder is not a resume
    expected = str(checkpoint_folder(tmp_path, 2))
    assert resolve_resume(tmp_path, None, auto_resume=True) == expected
    assert resolve_resume(tmp_path, True) == expected
    assert resolve_resume(tmp_path, None) is None and resolve_resume(tmp_path, False, auto_resume=True) is None
    assert will_resume(tmp_path, None, auto_resume=True)


def test_only_a_half_written_checkpoint_is_no_resume(tmp_path):
    _checkpoint(tmp_path, 4, complete=False)
    assert resolve_resume(tmp_path, None, auto_resume=True) is None
    assert not will_resume(tmp_path, None, auto_resume=True)  # the main job evaluates before, as from scratch
    with pytest.raises(ResumeError, match=r"^no complete checkpoint in .*; train without resume_from_checkpoint"):
        resolve_resume(tmp_path, True)
    folder = checkpoint_folder(tmp_path, 4)
    with pytest.raises(ResumeError, match=r"checkpoint-4 is interrupted: .*; omit resume_from_checkpoint"):
        resolve_resume(tmp_path, str(folder))
    assert will_resume(tmp_path, str(folder), auto_resume=False)  # given: checked when the run starts


def test_nothing_else_decides():
    """The trainers and the main jobs ask the rule; none tests `auto_resume` or globs `checkpoint-*` itself."""
    for path in ["trainers/resume.py", "trainers/recovery.py", "hf_llmkit/cli/job.py"]:
        source = (REPO / path).read_text()
        assert "resume_rule import" in source, path
        assert "resume_from_checkpoint is True" not in source and '"checkpoint-' not in source, path
