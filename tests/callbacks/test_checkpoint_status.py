"""The checkpoint classifier and what it allows: every way a checkpoint folder can be damaged, edited, left half
written or written by someone else, and what resume, tidying and rotation then do with it (issue 11, section 1)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from hf_llmkit.callbacks import (
    CheckpointState,
    FaultToleranceCallback,
    classify_checkpoint,
    latest_complete_checkpoint,
)
from hf_llmkit.checkpoints.housekeeping import drop_abandoned, remove_checkpoint, rotate_checkpoints, tidy_checkpoints
from hf_llmkit.checkpoints.manifest import mark_writing
from hf_llmkit.checkpoints.names import MANIFEST_NAME, list_checkpoints
from tests.callbacks.support import make_trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """checkpoint-2/4/6 of a 6-step LLMKitTrainer run with a FaultToleranceCallback (all complete)."""
    out = tmp_path_factory.mktemp("trained")
    make_trainer(out, callbacks=[FaultToleranceCallback()]).train()
    return out


@pytest.fixture
def run(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out, symlinks=True)
    return out


def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST_NAME).read_text())


def _edit_manifest(folder: Path, change) -> None:
    manifest = _manifest(folder)
    change(manifest)
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def _append(path: Path, data: bytes) -> None:
    path.write_bytes(path.read_bytes() + data)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _outside_entry(folder: Path) -> None:
    (folder.parent.parent / "outside.txt").write_text("not part of the checkpoint")
    _edit_manifest(folder, lambda m: m["files"].update({"../../outside.txt": {"size": 26}}))


def _symlinked_file(folder: Path) -> None:
    outside = folder.parent.parent / "config-outside.json"
    shutil.copy(folder / "config.json", outside)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(outside)


EDITS = {
    "intact": (lambda c: None, CheckpointState.COMPLETE, None),
    "manifest deleted": (lambda c: (c / MANIFEST_NAME).unlink(), CheckpointState.UNMANAGED, "no manifest"),
    "manifest deleted + our marker": (
        lambda c: ((c / MANIFEST_NAME).unlink(), mark_writing(c)),
        CheckpointState.INTERRUPTED,
        "never finished",
    ),
    "space added to config.json": (
        lambda c: _append(c / "config.json", b" "),
        CheckpointState.CORRUPT,
        "config.json has",
    ),
    "same-size byte flip": (lambda c: _flip(c / "optimizer.pt"), CheckpointState.CORRUPT, "optimizer.pt fails its"),
    "truncated weights": (lambda c: _truncate(c / "model.safetensors"), CheckpointState.CORRUPT, "100 bytes"),
    "file deleted": (lambda c: (c / "scheduler.pt").unlink(), CheckpointState.CORRUPT, "missing file scheduler.pt"),
    "garbage manifest": (
        lambda c: (c / MANIFEST_NAME).write_bytes(b"\x00\xffnot json"),
        CheckpointState.CORRUPT,
        "unreadable manifest",
    ),
    "manifest is a list": (lambda c: (c / MANIFEST_NAME).write_text("[]"), CheckpointState.CORRUPT, "unreadable"),
    "empty manifest": (
        lambda c: _edit_manifest(c, lambda m: m.update(files={})),
        CheckpointState.CORRUPT,
        "empty manifest",
    ),
    "'../' entry": (_outside_entry, CheckpointState.CORRUPT, "outside the folder"),
    "absolute entry": (
        lambda c: _edit_manifest(c, lambda m: m["files"].update({"/etc/hostname": {"size": 1}})),
        CheckpointState.CORRUPT,
        "outside the folder",
    ),
    "file symlinked out of the folder": (_symlinked_file, CheckpointState.CORRUPT, "outside the folder"),
    "unknown checksum": (
        lambda c: _edit_manifest(c, lambda m: m.update(checksum="nope")),
        CheckpointState.CORRUPT,
        "unknown checksum",
    ),
    "entry without size": (
        lambda c: _edit_manifest(c, lambda m: m["files"].update({"config.json": {}})),
        CheckpointState.CORRUPT,
        "no size",
    ),
    "no manifest, truncated weights": (
        lambda c: ((c / MANIFEST_NAME).unlink(), _truncate(c / "model.safetensors", 5000)),
        CheckpointState.INCOMPLETE,
        "model.safetensors: it has 5000 bytes",
    ),
    "no manifest, truncated optimizer": (
        lambda c: ((c / MANIFEST_NAME).unlink(), _truncate(c / "optimizer.pt", 5000)),
        CheckpointState.INCOMPLETE,
        "optimizer.pt: not a torch archive",
    ),
    "no manifest, no trainer state": (
        lambda c: ((c / MANIFEST_NAME).unlink(), (c / "trainer_state.json").unlink()),
        CheckpointState.INCOMPLETE,
        "no trainer_state.json",
    ),
    "no manifest, binary trainer state": (
        lambda c: ((c / MANIFEST_NAME).unlink(), (c / "trainer_state.json").write_bytes(b"\xff\xfe\x00")),
        CheckpointState.INCOMPLETE,
        "does not parse",
    ),
    "no manifest, no weights": (
        lambda c: ((c / MANIFEST_NAME).unlink(), (c / "model.safetensors").unlink()),
        CheckpointState.INCOMPLETE,
        "no model or adapter weights",
    ),
    "emptied folder": (
        lambda c: [p.unlink() for p in list(c.iterdir())],
        CheckpointState.INCOMPLETE,
        "no trainer_state.json",
    ),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_every_kind_of_folder_is_told_apart(run, edit):
    change, state, reason = EDITS[edit]
    checkpoint = run / "checkpoint-6"
    change(checkpoint)
    verdict = classify_checkpoint(checkpoint)
    assert verdict.state is state, verdict
    assert reason is None or reason in verdict.reason, verdict
    # Resume takes the newest checkpoint it can resume from, never a damaged one.
    expected = "checkpoint-6" if verdict.resumable else "checkpoint-4"
    assert Path(latest_complete_checkpoint(run)).name == expected


def test_tidying_deletes_only_our_interrupted_writes_and_moves_corrupt_ones_aside(run, caplog):
    _append(run / "checkpoint-2" / "config.json", b" ")  # edited
    (run / "checkpoint-4" / MANIFEST_NAME).unlink()
    mark_writing(run / "checkpoint-4")  # our write, interrupted
    with caplog.at_level("WARNING"):
        report = tidy_checkpoints(run, resume_step=6)
    assert report.deleted == ["checkpoint-4"] and report.corrupt == ["checkpoint-2"]
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == ["checkpoint-6", "corrupt-checkpoint-2"]
    assert any("config.json has" in r.getMessage() for r in caplog.records)  # the message says what differed
    assert classify_checkpoint(run / "checkpoint-6").state is CheckpointState.COMPLETE


def test_an_older_resume_point_keeps_newer_checkpoints_until_replaced(run):
    (run / "checkpoint-6" / MANIFEST_NAME).unlink()  # a plain Trainer's checkpoint: kept just the same
    report = tidy_checkpoints(run, resume_step=2)
    assert report.abandoned == ["checkpoint-4", "checkpoint-6"]
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-2"]
    assert classify_checkpoint(run / "abandoned-checkpoint-4").state is CheckpointState.COMPLETE
    assert latest_complete_checkpoint(run).endswith("checkpoint-2")  # never resumed from by accident
    assert drop_abandoned(run) == ["abandoned-checkpoint-4", "abandoned-checkpoint-6"]
    assert not list(run.glob("abandoned-*"))


def test_newer_folders_that_do_not_load_are_moved_aside_not_deleted(run):
    (run / "checkpoint-6" / MANIFEST_NAME).unlink()
    _truncate(run / "checkpoint-6" / "optimizer.pt")
    assert tidy_checkpoints(run, resume_step=4).incomplete == ["checkpoint-6"]
    assert (run / "incomplete-checkpoint-6" / "model.safetensors").is_file()


def test_nothing_follows_a_symlink_out_of_the_output_folder(run, tmp_path):
    outside = tmp_path / "elsewhere" / "checkpoint-8"
    shutil.copytree(run / "checkpoint-6", outside)
    (outside / MANIFEST_NAME).unlink()
    mark_writing(outside)  # looks like our interrupted write, but lives outside output_dir
    (run / "checkpoint-8").symlink_to(outside, target_is_directory=True)
    tidy_checkpoints(run, resume_step=6)
    assert remove_checkpoint(run / "checkpoint-8") is False
    assert rotate_checkpoints(run, 1) and (outside / "model.safetensors").is_file()
    # A file of a rotated checkpoint that links out of it: the link goes, its target stays.
    target = tmp_path / "precious.txt"
    target.write_bytes(b"keep me")
    (run / "checkpoint-6" / "extra.txt").symlink_to(target)
    shutil.copytree(run / "checkpoint-6", run / "checkpoint-10", symlinks=True)
    (run / "checkpoint-10" / MANIFEST_NAME).unlink()  # loads: unmanaged, the newest
    state = json.loads((run / "checkpoint-10" / "trainer_state.json").read_text())
    (run / "checkpoint-10" / "trainer_state.json").write_text(json.dumps({**state, "global_step": 10}))
    rotate_checkpoints(run, 1)
    assert not (run / "checkpoint-6").exists() and target.read_bytes() == b"keep me"
    assert os.path.islink(run / "checkpoint-8") and outside.is_dir()


def test_rotation_never_deletes_corrupt_incomplete_or_the_newest(run):
    _flip(run / "checkpoint-2" / "optimizer.pt")  # corrupt only by checksum: rotation compares sizes
    _truncate(run / "checkpoint-4" / "model.safetensors")  # corrupt by size
    (run / "checkpoint-8").mkdir()  # incomplete, newer
    deleted = rotate_checkpoints(run, 1)
    assert [p.name for p in deleted] == ["checkpoint-2"]  # sizes match: an old resumable checkpoint
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert rotate_checkpoints(run, 1) == []
