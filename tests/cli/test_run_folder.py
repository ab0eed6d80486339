"""A main job's output folder belongs to one run (issue 33): two different runs with no `--output_dir` get folders
of their own (the second says which), the same run resumes in its own, and an explicit `--output_dir` holding
another run is refused before any work in one line naming only the flags the user changed."""

from __future__ import annotations

import json
import logging

import pytest

import hf_llmkit.cli.job as job_module
from hf_llmkit.cli.run_folder import FLAG_RECORD, choose_default_folder, flag_differences
from tests.examples.test_run_clm import TINY

ONE_STEP = [*TINY, "--max_steps", "1", "--save_steps", "1", "--do_eval", "false"]


@pytest.fixture
def first(run_clm, tmp_path, monkeypatch):
    """A 1-step run in the default folder, outputs/run_clm of a scratch folder."""
    monkeypatch.chdir(tmp_path)
    results = run_clm.run(ONE_STEP)
    assert results["output_dir"] == "outputs/run_clm" and results["global_step"] == 1
    return tmp_path / "outputs"


def _no_work(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was built: the refusal came after work started")

    monkeypatch.setattr(job_module, "build_model", refuse)


def test_a_different_run_with_no_output_dir_gets_a_folder_of_its_own_and_says_which(run_clm, first, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_llmkit"):
        results = run_clm.run([*ONE_STEP, "--seed", "7"])
    assert results["output_dir"] == "outputs/run_clm-2" and results["resumed_at"] == 0
    [line] = [r.getMessage() for r in caplog.records if "holds a different run" in r.getMessage()]
    assert line == "outputs/run_clm holds a different run (--seed: 42 -> 7): this run uses outputs/run_clm-2 " + (
        "(--output_dir chooses)"
    )
    assert json.loads((first / "run_clm" / FLAG_RECORD).read_text())["seed"] == 42  # the first run's, untouched
    again = run_clm.run([*ONE_STEP, "--seed", "7", "--max_steps", "2"])  # each run resumes in its own folder
    assert again["output_dir"] == "outputs/run_clm-2" and again["resumed_at"] == 1
    longer = run_clm.run([*ONE_STEP, "--max_steps", "2", "--learning_rate", "5e-4"])  # settings a resume may change
    assert longer["output_dir"] == "outputs/run_clm" and longer["resumed_at"] == 1


def test_an_explicit_output_dir_of_another_run_is_refused_before_any_work(run_clm, first, monkeypatch):
    _no_work(monkeypatch)
    before = sorted(p.name for p in (first / "run_clm").iterdir())
    with pytest.raises(run_clm.UsageError) as error:
        run_clm.run([*ONE_STEP, "--seed", "7", "--output_dir", "outputs/run_clm"])
    message = str(error.value)
    assert message.startswith("--output_dir outputs/run_clm holds a different run (--seed: 42 -> 7); ")
    assert "digest" not in message and "\n" not in message and "--overwrite_output_dir true" in message
    assert sorted(p.name for p in (first / "run_clm").iterdir()) == before


def test_overwrite_output_dir_starts_another_run_over_in_an_explicit_folder(run_clm, first):
    results = run_clm.run(
        [*ONE_STEP, "--seed", "7", "--output_dir", "outputs/run_clm", "--overwrite_output_dir", "true"]
    )
    assert results["resumed_at"] == 0 and json.loads((first / "run_clm" / FLAG_RECORD).read_text())["seed"] == 7


def test_a_folder_holding_no_run_is_anyones(tmp_path):
    base = str(tmp_path / "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / FLAG_RECORD).write_text(json.dumps({"seed": 1}))  # a run that stopped before any checkpoint
    assert choose_default_folder(base, {"seed": 2}) == (base, [])
    (tmp_path / "run" / "checkpoint-1").mkdir()
    assert choose_default_folder(base, {"seed": 2}) == (f"{base}-2", ["--seed: 1 -> 2"])
    assert choose_default_folder(base, {"seed": 1}) == (base, [])


def test_differences_name_flags_and_leave_out_what_one_record_lacks():
    old = {"job": "run_clm.py", "ranks": 1, "seed": 42, "lora_rank": 8}
    new = {"job": "run_sft.py", "ranks": 2, "seed": 42, "lora_rank": 4, "added_later": 1}
    assert flag_differences(old, new) == ["job: run_clm.py -> run_sft.py", "ranks: 1 -> 2", "--lora_rank: 8 -> 4"]


def test_a_finished_default_folder_run_without_a_record_is_not_taken(run_clm, tmp_path, monkeypatch, caplog):
    """Issue 46: its record deleted (or a folder from before records), a finished run's model and results were
    replaced by the next default-folder run with other flags."""
    monkeypatch.chdir(tmp_path)
    flags = [*ONE_STEP, "--save_strategy", "no"]
    run_clm.run([*flags, "--seed", "31"])
    folder = tmp_path / "outputs" / "run_clm"
    (folder / FLAG_RECORD).unlink()
    kept = {name: (folder / name).read_bytes() for name in ("model.safetensors", "train_results.json")}
    with caplog.at_level(logging.WARNING, logger="hf_llmkit"):
        results = run_clm.run([*flags, "--seed", "32"])
    assert results["output_dir"] == "outputs/run_clm-2"
    assert {name: (folder / name).read_bytes() for name in kept} == kept
    [line] = [r.getMessage() for r in caplog.records if "holds a different run" in r.getMessage()]
    assert f"(its flags are not recorded: no {FLAG_RECORD})" in line
    unrecorded = f"holds a finished run whose flags are not recorded .no {FLAG_RECORD}"
    with pytest.raises(run_clm.UsageError, match=unrecorded):
        run_clm.run([*flags, "--seed", "32", "--output_dir", "outputs/run_clm"])  # named: refused, before any work
    assert {name: (folder / name).read_bytes() for name in kept} == kept and not (folder / FLAG_RECORD).exists()


def test_a_refused_run_leaves_the_folders_record_as_it_was(run_clm, first):
    """Issue 46: a run the checkpoint's run record refuses wrote its own flag record first, so the folder's own run
    was then sent elsewhere and the refused one refused for ever."""
    folder = first / "run_clm"
    (folder / FLAG_RECORD).unlink()  # the checkpoint's run record decides
    from hf_llmkit.checkpoints.endings import ResumeError

    with pytest.raises(ResumeError, match="belongs to a different run .seed: 42 -> 9"):
        run_clm.run([*ONE_STEP, "--seed", "9", "--max_steps", "2", "--output_dir", "outputs/run_clm"])
    assert not (folder / FLAG_RECORD).exists()
    resumed = run_clm.run([*ONE_STEP, "--max_steps", "2", "--output_dir", "outputs/run_clm"])  # its own run resumes
    assert resumed["resumed_at"] == 1 and json.loads((folder / FLAG_RECORD).read_text())["seed"] == 42
