"""A checkpoint knows which run wrote it: resuming another run into the same folder stops before any work with one
line naming the difference and the fix; the same run with another schedule or logging resumes (issue 10, 2)."""

from __future__ import annotations

import json

import pytest
from peft import LoraConfig, get_peft_model

from hf_llmkit.callbacks import FaultToleranceCallback
from hf_llmkit.testing import tiny_llama
from hf_llmkit.trainers import ResumeError
from hf_llmkit.trainers.run_identity import RUN_IDENTITY_FILE, differences
from tests.callbacks.support import SMALL, Blocks, make_trainer, small_model
from tests.examples.test_run_clm import TINY


@pytest.fixture
def run(tmp_path):
    make_trainer(tmp_path, callbacks=[FaultToleranceCallback()], max_steps=2).train()
    return tmp_path


def test_the_checkpoint_records_the_run(run):
    record = json.loads((run / "checkpoint-2" / RUN_IDENTITY_FILE).read_text())
    assert record["model"]["hidden_size"] == 32 and record["peft"] is None and record["data"]["samples"] == 32
    assert record["sequence_parallel_size"] == 1 and record["parameters"]["count"] > 0


def test_the_same_run_with_another_schedule_and_logging_resumes(run):
    trainer = make_trainer(
        run, callbacks=[FaultToleranceCallback()], max_steps=4, save_steps=1, logging_steps=2, learning_rate=1e-3
    )
    assert trainer.train(resume_from_checkpoint=True).global_step == 4


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(model=lambda: tiny_llama(**{**SMALL, "hidden_size": 64}).train()), "model.hidden_size: 32 -> 64"),
        (dict(model=lambda: get_peft_model(small_model(), LoraConfig(r=4, target_modules=["q_proj"]))),
         "peft: none -> default=LORA"),
        (dict(data=lambda: Blocks(n=40)), "data.samples: 32 -> 40"),
    ],
    ids=["model-size", "peft-method", "data"],
)  # fmt: skip
def test_another_run_is_refused_before_any_work(run, change, named):
    kwargs = {key: factory() for key, factory in change.items()}
    trainer = make_trainer(run, callbacks=[FaultToleranceCallback()], max_steps=4, **kwargs)
    with pytest.raises(ResumeError, match="belongs to a different run") as error:
        trainer.train(resume_from_checkpoint=True)
    message = str(error.value)
    assert named in message and "--output_dir" in message and "--overwrite_output_dir true" in message
    assert error.value.code == 2 and "\n" not in message
    assert trainer.state.global_step == 0 and sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2"]


def test_differences_are_named_field_by_field():
    old = {"model": {"hidden_size": 32, "model_type": "llama"}, "sequence_parallel_size": 1, "peft": None}
    new = {"model": {"hidden_size": 32, "model_type": "mixtral"}, "sequence_parallel_size": 2, "peft": None}
    assert differences(old, new) == ["model.model_type: llama -> mixtral", "sequence_parallel_size: 1 -> 2"]
    assert differences({"peft": None}, {"peft": {"default": {"peft_type": "BOTTLENECK", "r": 8}}}) == [
        "peft: none -> default=BOTTLENECK"
    ]


def test_readme_commands_into_the_quickstart_folder_stop_with_one_line(run_clm, tmp_path):
    """The README's feature commands, run after the quickstart into its output folder (issue 10, section 2)."""
    common = [*TINY, "--output_dir", str(tmp_path), "--max_steps", "2", "--save_steps", "2"]
    run_clm.run(common)
    for flags, named in (
        (["--peft_method", "bottleneck", "--bottleneck_placement", "houlsby"], "(--peft_method: none -> bottleneck"),
        (["--upcycle_moe", "true", "--moe_num_experts", "4", "--moe_top_k", "2"], "(--upcycle_moe: false -> true"),
    ):  # refused from the flags, before any work (issue 33; the checkpoint's record is the backstop)
        with pytest.raises(run_clm.UsageError, match="holds a different run") as error:
            run_clm.run([*common, *flags])
        assert named in str(error.value)
    assert run_clm.run([*common[:-4], "--max_steps", "3", "--save_steps", "2"])["global_step"] == 3  # same run
    # The results files stay strict JSON after a resume, and say which steps the loss covers (issue 21, 4).
    train = _strict_json(tmp_path / "train_results.json")
    assert train["train_loss_steps"] == "3-3" and train["train_loss"] > 0 and train["epoch"] > 0
    # Re-run once finished: nothing to train, and the recorded results stay as they were (issue 33).
    recorded = {name: (tmp_path / name).read_bytes() for name in ("train_results.json", "all_results.json")}
    again = run_clm.run([*common[:-4], "--max_steps", "3", "--save_steps", "2"])
    assert again["global_step"] == again["resumed_at"] == 3
    assert again["train_loss"] == train["train_loss"] and again["eval_loss"] is not None  # the recorded ones
    assert {name: (tmp_path / name).read_bytes() for name in recorded} == recorded
    with pytest.raises(ResumeError, match=r"--max_steps 2 ends before step 3, which .*checkpoint-3 reached"):
        run_clm.run([*common[:-4], "--max_steps", "2", "--save_steps", "2"])  # a shorter run is another run
    assert {name: (tmp_path / name).read_bytes() for name in recorded} == recorded


def _strict_json(path) -> dict:
    def refuse(constant):
        raise AssertionError(f"{path.name} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)
