"""Contract of the checkpoint transaction (issue 34, 1): every contributor is registered, every file of a real
checkpoint was written by a registered contributor inside its transaction (before the manifest), and a write into a
checkpoint that is complete raises."""

from __future__ import annotations

import ast
import functools
import hashlib
import json

import pytest
from peft import LoraConfig, get_peft_model
from transformers import TrainerCallback

from hf_llmkit.callbacks import FaultToleranceCallback, SavePeftModelCallback, verify_checkpoint
from hf_llmkit.checkpoints.lifecycle import ManifestSettings
from hf_llmkit.checkpoints.manifest import payload_files
from hf_llmkit.checkpoints.names import MANIFEST_NAME, TRAINER_STATE, checkpoint_folder
from hf_llmkit.checkpoints.transaction import (
    GUARD,
    WRITER,
    CheckpointClosedError,
    begin_save,
    contributors,
    owns,
    register_contributor,
    transaction_of,
)
from hf_llmkit.quantization import DKMTrainingStateCallback
from hf_llmkit.trainers import LLMKitTrainer  # noqa: F401 - its modules register their contributors
from tests.callbacks.support import make_trainer, small_model
from tests.conftest import REPO

LIBRARY = [REPO / "hf_llmkit", REPO / "callbacks", REPO / "trainers"]


@functools.cache
def _called() -> dict[str, set[str]]:
    """Library file (relative path) -> the names it calls."""
    found = {}
    for path in sorted(p for folder in LIBRARY for p in folder.rglob("*.py")):
        calls = (n.func for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call))
        found[path.relative_to(REPO).as_posix()] = {getattr(f, "id", getattr(f, "attr", None)) for f in calls}
    return found


def _calls(name: str) -> list[str]:
    """The library files that call `name(...)`."""
    return [path for path, names in _called().items() if name in names]


def test_every_contributor_is_registered_by_the_module_that_writes_it():
    adapter = SavePeftModelCallback(subfolder="adapter", merged_subfolder="merged")
    names = {c.name: c for c in contributors()}
    assert {WRITER, "run identity", "dkm training state", adapter.checkpoint_part} <= set(names)
    # every registration in the library is one of these (a new contributor is added to this test)
    assert sorted(_calls("register_contributor")) == [
        "callbacks/save_peft.py",
        "hf_llmkit/checkpoints/transaction.py",
        "hf_llmkit/quantization/training_state.py",
        "trainers/run_identity.py",
    ]
    assert names["dkm training state"].via == WRITER and not names["dkm training state"].files
    assert owns(adapter.checkpoint_part, "merged/model.safetensors") and owns("run identity", "llmkit_run.json")
    with pytest.raises(ValueError, match="already registered by"):
        register_contributor("run identity", files=("elsewhere.json",), writer="tests")


def test_only_the_transaction_begins_and_completes_a_checkpoint():
    assert _calls("begin_checkpoint") == ["hf_llmkit/checkpoints/transaction.py"]
    assert _calls("complete_checkpoint") == ["hf_llmkit/checkpoints/transaction.py"]


class _Recorder(TrainerCallback):
    """Last in the list: keeps each save's transaction (the run drops its records when it ends)."""

    def __init__(self):
        self.seen = {}

    def on_save(self, args, state, control, **kwargs):
        folder = checkpoint_folder(args.output_dir, state.global_step)
        self.seen[folder] = transaction_of(folder)


def _lora():
    return get_peft_model(small_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


@pytest.mark.parametrize("guarded", [True, False], ids=["guard-first", "no-guard"])
def test_every_file_of_a_checkpoint_is_a_registered_part_written_before_it_completes(tmp_path, guarded):
    """LLMKitTrainer + SavePeftModelCallback (after the guard: today's problem order) + DKM's callback: each file
    of every checkpoint was written through a registered part, is declared by it, and predates the manifest."""
    recorder = _Recorder()
    guard = [FaultToleranceCallback()] if guarded else []
    callbacks = [*guard, SavePeftModelCallback(save_merged=True), DKMTrainingStateCallback(), recorder]
    make_trainer(tmp_path, model=_lora(), callbacks=callbacks, max_steps=2, save_steps=1).train()
    assert sorted(p.name for p in recorder.seen) == ["checkpoint-1", "checkpoint-2"]
    for folder, txn in recorder.seen.items():
        assert txn is not None and txn.state == "complete" and txn.joined == ([GUARD, WRITER] if guarded else [WRITER])
        files = {p.relative_to(folder).as_posix(): p for p in payload_files(folder)}
        assert {"adapter/adapter_model.safetensors", "merged/model.safetensors", TRAINER_STATE} <= set(files)
        unaccounted = {name: txn.written.get(name) for name in files if not owns(txn.written.get(name, ""), name)}
        assert unaccounted == {}, folder
        assert set(txn.written.values()) == {WRITER, "run identity", callbacks[len(guard)].checkpoint_part}
        if guarded:  # the manifest is written last and lists every file
            manifest = folder / MANIFEST_NAME
            assert set(json.loads(manifest.read_text())["files"]) == set(files)
            late = [n for n, p in files.items() if p.stat().st_mtime_ns > manifest.stat().st_mtime_ns]
            assert late == [] and verify_checkpoint(folder) is None


def test_the_second_party_joins_and_the_last_to_finish_completes(tmp_path):
    folder = checkpoint_folder(tmp_path, 3)
    txn = begin_save(folder, participant=GUARD, main=True)
    assert begin_save(folder, participant=WRITER, main=True) is txn and txn.joined == [GUARD, WRITER]
    with txn.part(WRITER) as target:
        (target / TRAINER_STATE).write_text("{}")
    done = dict(output_dir=tmp_path, save_total_limit=None)
    assert not txn.finish(WRITER, **done) and txn.is_open and not (folder / MANIFEST_NAME).exists()
    assert txn.finish(GUARD, manifest=ManifestSettings(fsync=False), **done) and txn.state == "complete"
    digest = hashlib.sha256(b"{}").hexdigest()
    assert json.loads((folder / MANIFEST_NAME).read_text())["files"] == {TRAINER_STATE: {"size": 2, "sha256": digest}}
    assert begin_save(folder, participant=WRITER, main=True).state == "skipped"  # it loads: not written again


def test_a_contributor_writing_after_completion_raises(tmp_path):
    folder = checkpoint_folder(tmp_path, 1)
    txn = begin_save(folder, participant=WRITER, main=True)
    with txn.part(WRITER) as target:
        (target / TRAINER_STATE).write_text("{}")
    txn.finish(WRITER, output_dir=tmp_path, save_total_limit=None)
    closed = r"cannot write into .*checkpoint-1: its checkpoint is complete"
    with pytest.raises(CheckpointClosedError, match=closed), txn.part("run identity"):
        pass
    adapter = SavePeftModelCallback()
    with pytest.raises(CheckpointClosedError, match="is complete"):
        adapter.write_checkpoint_part(txn, model=_lora())
    assert not (folder / "adapter").exists()
    other = begin_save(checkpoint_folder(tmp_path, 2), participant=WRITER, main=True)
    with pytest.raises(ValueError, match="no registered checkpoint contributor"), other.part("mine"):
        pass


def test_an_abandoned_save_is_removed_and_closed(tmp_path):
    folder = checkpoint_folder(tmp_path, 1)
    txn = begin_save(folder, participant=GUARD, main=True)
    txn.abandon()
    assert not folder.exists() and txn.state == "abandoned"
    with pytest.raises(CheckpointClosedError):
        txn.finish(GUARD, output_dir=tmp_path, save_total_limit=None)
