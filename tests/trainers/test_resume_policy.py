"""The declared policy for a resume with changed settings (issue 21, section 2; the table is in docs/callbacks.md):
one test per row, all resuming copies of one tiny saved checkpoint. A setting that changes what the checkpoint is
stops the run before any work with one line naming exactly that setting; a setting a user may change takes effect,
and the run says in one line what it changed from what to what.

Rows tested elsewhere: model sizes, PEFT method and data samples (test_run_identity.py), the number of ranks
(tests/callbacks/test_multirank.py, a real 2-rank checkpoint resumed on 1 rank)."""

from __future__ import annotations

import logging
import re
import shutil

import pytest
from transformers import TrainerCallback

from hf_llmkit.callbacks import FaultToleranceCallback
from hf_llmkit.checkpoints import ResumeError
from hf_llmkit.quantization import DKMConfig, quantize_model
from tests.callbacks.support import Blocks, make_trainer, small_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """checkpoint-2 of a 2-step run (learning rate 5e-3, linear decay to 0 at step 2)."""
    out = tmp_path_factory.mktemp("saved")
    make_trainer(out, callbacks=[FaultToleranceCallback()], max_steps=2).train()
    return out


@pytest.fixture
def run(saved, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    return out


REFUSED = {
    "seed": (dict(seed=1), "seed: 0 -> 1"),
    "per_device_train_batch_size": (dict(per_device_train_batch_size=2), "per_device_train_batch_size: 4 -> 2"),
    "gradient_accumulation_steps": (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps: 1 -> 2"),
    "optimizer": (dict(optim="sgd"), "optim: adamw_torch_fused -> sgd"),
    "weight_decay": (dict(weight_decay=0.1), "weight_decay: 0.0 -> 0.1"),
    "block_size": (dict(data=lambda: Blocks(length=12)), "the training samples ("),
    "quantization": (dict(model=lambda: quantize_model(small_model(), DKMConfig(bits=3))), "quantization: none -> "),
}


@pytest.mark.parametrize("row", sorted(REFUSED))
def test_a_setting_that_changes_the_checkpoint_is_refused_naming_only_it(run, row):
    change, named = REFUSED[row]
    kwargs = {key: value() if callable(value) else value for key, value in change.items()}
    trainer = make_trainer(run, callbacks=[FaultToleranceCallback()], max_steps=4, **kwargs)
    with pytest.raises(ResumeError, match="belongs to a different run") as error:
        trainer.train(resume_from_checkpoint=True)
    message = str(error.value)
    [listed] = re.findall(r"different run \((.*?)\); resume with the recorded values", message)
    assert listed.startswith(named) and "; " not in listed, listed  # this setting and nothing else
    assert error.value.code == 2 and "\n" not in message and trainer.state.global_step == 0


class _RatesUsed(TrainerCallback):
    """The learning rate each step's update uses."""

    def __init__(self):
        self.rates: dict[int, float] = {}

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.rates[state.global_step + 1] = optimizer.param_groups[0]["lr"]


def test_a_new_learning_rate_and_length_take_effect_and_are_said_in_one_line(run, tmp_path, caplog):
    rates = _RatesUsed()
    trainer = make_trainer(run, callbacks=[FaultToleranceCallback(), rates], max_steps=4, learning_rate=1e-3)
    with caplog.at_level(logging.WARNING, logger="hf_llmkit"):
        trainer.train(resume_from_checkpoint=True)
    [line] = [r.getMessage() for r in caplog.records if "changed settings" in r.getMessage()]
    assert line.endswith("with changed settings: learning_rate 0.005 -> 0.001; max_steps 2 -> 4"), line
    # The steps after the resume use the rates of an uninterrupted run with the new settings (linear decay over 4).
    fresh = _RatesUsed()
    make_trainer(tmp_path / "fresh", callbacks=[fresh], max_steps=4, learning_rate=1e-3, save_strategy="no").train()
    assert rates.rates == {3: fresh.rates[3], 4: fresh.rates[4]} and fresh.rates[3] == pytest.approx(5e-4)


def test_logging_and_save_cadence_take_effect_and_are_said_in_one_line(run, caplog):
    trainer = make_trainer(run, callbacks=[FaultToleranceCallback()], max_steps=4, save_steps=1, logging_steps=2)
    with caplog.at_level(logging.WARNING, logger="hf_llmkit"):
        trainer.train(resume_from_checkpoint=True)
    [line] = [r.getMessage() for r in caplog.records if "changed settings" in r.getMessage()]
    assert line.endswith("with changed settings: logging_steps 1 -> 2; max_steps 2 -> 4; save_steps 2 -> 1"), line
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [1, 2, 4]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]


def test_a_new_learning_rate_keeps_a_groups_fixed_fraction_of_it():
    import torch

    from hf_llmkit.trainers.changed_settings import apply_optimizer_changes

    full, latent = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [full]}, {"params": [latent], "lr": 5e-4, "lr_scale": 0.1}], lr=5e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 4)
    optimizer.step(), scheduler.step()  # at step 1 of 4
    apply_optimizer_changes(optimizer, scheduler, [("learning_rate", 5e-3, 1e-3)])
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([7.5e-4, 7.5e-5])  # DKM's latent weights
    assert scheduler.base_lrs == pytest.approx([1e-3, 1e-4])
