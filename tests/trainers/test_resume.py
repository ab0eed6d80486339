"""LLMKitTrainer resumes from every checkpoint it can, and never loses one: edited, foreign, older-resume and
final-folder cases of issue 11, run end to end on the tiny model."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import TrainerCallback

from hf_llmkit.callbacks import CheckpointState, FaultToleranceCallback, classify_checkpoint, verify_checkpoint
from hf_llmkit.checkpoints.names import MANIFEST_NAME
from hf_llmkit.trainers import ResumeError
from tests.callbacks.support import make_trainer


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if "checkpoint" in p.name)


def _logged_steps(trainer) -> list[int]:
    return [entry["step"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """checkpoint-2 and checkpoint-4 (complete) and the final model of a 4-step run."""
    out = tmp_path_factory.mktemp("four")
    trainer = make_trainer(out, callbacks=[FaultToleranceCallback()], max_steps=4)
    trainer.train()
    trainer.save_model()
    return out


@pytest.fixture
def run(four_steps, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(four_steps, out)
    return out


def test_a_checkpoint_whose_manifest_was_deleted_is_resumed_not_deleted(run):
    (run / "checkpoint-4" / MANIFEST_NAME).unlink()
    trainer = make_trainer(run, callbacks=[FaultToleranceCallback()], max_steps=6, auto_resume=True)
    trainer.train()
    assert _logged_steps(trainer) == [1, 2, 3, 4, 5, 6]  # steps 5-6 continue the history of checkpoint-4
    assert _names(run) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def test_an_edited_checkpoint_is_moved_aside_and_the_previous_one_resumed(run, caplog):
    config = run / "checkpoint-4" / "config.json"
    config.write_text(config.read_text() + " ")
    trainer = make_trainer(run, callbacks=[FaultToleranceCallback()], max_steps=4, auto_resume=True)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert "corrupt-checkpoint-4" in _names(run)  # kept, under a name nothing resumes from or rotates
    assert any("config.json has" in r.getMessage() for r in caplog.records)
    assert verify_checkpoint(run / "checkpoint-4") is None  # written again from checkpoint-2


@pytest.mark.parametrize("plain", [True, False], ids=["plain-trainer", "no-fault-tolerance"])
def test_checkpoints_written_without_manifests_are_resumed(tmp_path, plain):
    make_trainer(tmp_path, plain=plain, max_steps=4, save_total_limit=2).train()
    assert not (tmp_path / "checkpoint-4" / MANIFEST_NAME).exists()
    again = make_trainer(tmp_path, callbacks=[FaultToleranceCallback()], max_steps=6, save_total_limit=2)
    again.train(resume_from_checkpoint=True)
    assert _logged_steps(again) == [1, 2, 3, 4, 5, 6]
    assert _names(tmp_path) == ["checkpoint-4", "checkpoint-6"]  # rotation kept the newest two


class _Snapshot(TrainerCallback):
    """The checkpoint folders at the first step, and after each save."""

    def __init__(self, out):
        self.out, self.seen = out, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen.setdefault("start", _names(self.out))

    def on_save(self, args, state, control, **kwargs):
        self.seen[state.global_step] = _names(self.out)


def test_an_older_resume_point_keeps_newer_checkpoints_until_this_run_has_one(run):
    snapshot = _Snapshot(run)
    callbacks = [FaultToleranceCallback(), snapshot]
    trainer = make_trainer(run, callbacks=callbacks, max_steps=4, learning_rate=1e-3)
    trainer.train(resume_from_checkpoint=str(run / "checkpoint-2"))
    # Until this run wrote a complete checkpoint, the newer one was kept (out of the resume path).
    assert snapshot.seen["start"] == ["abandoned-checkpoint-4", "checkpoint-2"]
    assert snapshot.seen[4] == ["checkpoint-2", "checkpoint-4"]
    assert verify_checkpoint(run / "checkpoint-4") is None


def test_a_step_that_is_already_saved_is_not_written_again(run):
    trainer = make_trainer(run, callbacks=[FaultToleranceCallback()], max_steps=4, auto_resume=True)
    trainer.train()
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoint-4").iterdir()}
    trainer._save_checkpoint(trainer.model, trial=None)  # e.g. an epoch-end save right after a preemption save
    assert {p.name: p.stat().st_mtime_ns for p in (run / "checkpoint-4").iterdir()} == before


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("missing", "does not exist"),
        ("corrupt", "is corrupt: optimizer.pt fails its sha256 checksum; resume from"),
        ("empty", "is incomplete: no manifest and no trainer_state.json"),
    ],
)
def test_an_explicit_resume_folder_that_cannot_be_resumed_is_one_line(run, target, message):
    folder = run / "checkpoint-4"
    if target == "missing":
        folder = run / "checkpoint-99"
    elif target == "corrupt":
        data = bytearray((folder / "optimizer.pt").read_bytes())
        data[100] ^= 1
        (folder / "optimizer.pt").write_bytes(bytes(data))
    else:
        folder = run / "empty"
        folder.mkdir()
    trainer = make_trainer(run, callbacks=[FaultToleranceCallback()], max_steps=6)
    with pytest.raises(ResumeError, match=message) as error:
        trainer.train(resume_from_checkpoint=str(folder))
    assert error.value.code == 2 and "\n" not in str(error.value)
    assert trainer.state.global_step == 0  # refused before any work


def test_final_model_folder_carries_a_manifest(run):
    assert verify_checkpoint(run) is None
    listed = set(json.loads((run / MANIFEST_NAME).read_text())["files"])
    assert {"model.safetensors", "config.json"} <= listed and not any("checkpoint" in n for n in listed)
    (run / "model.safetensors").write_bytes((run / "model.safetensors").read_bytes()[:-1])
    assert "model.safetensors has" in verify_checkpoint(run)


def test_best_model_checkpoint_is_verified_before_loading(tmp_path):
    from tests.callbacks.support import Blocks

    trainer = make_trainer(
        tmp_path,
        callbacks=[FaultToleranceCallback()],
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        eval_data=Blocks(8),
        load_best_model_at_end=True,
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert classify_checkpoint(best).state is CheckpointState.COMPLETE
    with open(f"{best}/model.safetensors", "r+b") as weights:
        weights.seek(-8, 2)
        weights.write(b"\x00\x01")
    with pytest.raises(ResumeError, match="cannot load the best model"):
        trainer._load_best_model()


def test_a_symlink_at_the_step_to_write_is_replaced_not_written_through(run, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not a checkpoint")
    (run / "checkpoint-6").symlink_to(outside, target_is_directory=True)
    make_trainer(run, callbacks=[FaultToleranceCallback()], max_steps=6, auto_resume=True).train()
    assert not (run / "checkpoint-6").is_symlink() and verify_checkpoint(run / "checkpoint-6") is None
    assert [p.name for p in outside.iterdir()] == ["keep.txt"]


def test_an_output_dir_that_cannot_be_written_is_found_before_training(tmp_path):
    target = tmp_path / "out"
    trainer = make_trainer(target, callbacks=[FaultToleranceCallback()], max_steps=2)
    shutil.rmtree(target, ignore_errors=True)
    target.write_text("not a folder")  # e.g. a typo that names an existing file
    with pytest.raises(ResumeError, match="output_dir .* is a file; pass a writable folder") as error:
        trainer.train()
    assert error.value.code == 2 and trainer.state.global_step == 0


def test_renamed_checkpoint_folders_are_not_trusted(run):
    (run / "checkpoint-4").rename(run / "checkpoint-8")
    assert "renamed: its manifest is for checkpoint-4" in classify_checkpoint(run / "checkpoint-8").reason
    (run / "checkpoint-8" / MANIFEST_NAME).unlink()
    assert "is for step 4, not 8" in classify_checkpoint(run / "checkpoint-8").reason
