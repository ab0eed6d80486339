"""FaultToleranceCallback: manifests, resume selection, rotation, NaN/spike rollback, preemption, save retries."""

from __future__ import annotations

import errno
import json
import os
import signal

import pytest
import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.callbacks import (
    CheckpointWriteError,
    FaultToleranceCallback,
    TrainingDivergedError,
    latest_complete_checkpoint,
    verify_checkpoint,
)
from hf_llmkit.checkpoints.housekeeping import rotate_checkpoints
from hf_llmkit.checkpoints.manifest import mark_writing
from hf_llmkit.checkpoints.names import MANIFEST_NAME, list_checkpoints
from tests.callbacks.support import Blocks, data_order, make_trainer, poison_loss, record_blocks, small_model


@pytest.fixture(scope="module")
def order(tmp_path_factory):
    """The blocks each step of an uninterrupted 8-step run sees."""
    return data_order(tmp_path_factory.mktemp("order"), steps=8)


def _names(paths) -> list[str]:
    return [p.name for p in paths]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 6-step run with a checkpoint every 2 steps (no rotation)."""
    out = tmp_path_factory.mktemp("trained")
    make_trainer(out, callbacks=[FaultToleranceCallback()]).train()
    return out


def test_every_checkpoint_gets_a_verifiable_manifest(trained):
    assert _names(list_checkpoints(trained)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for checkpoint in list_checkpoints(trained):
        assert verify_checkpoint(checkpoint) is None
        names = set(json.loads((checkpoint / MANIFEST_NAME).read_text())["files"])
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "rng_state.pth"} <= names


def test_resume_skips_incomplete_and_corrupt_checkpoints(trained, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    # checkpoint-6: our write that never finished (marker, no manifest) -> get_last_checkpoint still picks it
    (out / "checkpoint-6" / MANIFEST_NAME).unlink()
    mark_writing(out / "checkpoint-6")
    assert get_last_checkpoint(str(out)).endswith("checkpoint-6")
    assert latest_complete_checkpoint(out).endswith("checkpoint-4")
    # checkpoint-4: same size, one flipped byte -> only the checksum notices
    weights = out / "checkpoint-4" / "optimizer.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert verify_checkpoint(out / "checkpoint-4", checksums=False) is None
    assert "checksum" in verify_checkpoint(out / "checkpoint-4")
    assert latest_complete_checkpoint(out).endswith("checkpoint-2")
    # checkpoint-2: truncated file
    model = out / "checkpoint-2" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:100])
    assert "bytes" in verify_checkpoint(out / "checkpoint-2", checksums=False)
    assert latest_complete_checkpoint(out) is None


def test_rotation_keeps_newest_complete_and_drops_stale_incomplete(trained, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-1")
    (out / "checkpoint-1" / MANIFEST_NAME).unlink()
    mark_writing(out / "checkpoint-1")  # an old write of ours that never finished: garbage
    shutil.copytree(out / "checkpoint-6", out / "checkpoint-8")
    (out / "checkpoint-8" / MANIFEST_NAME).unlink()
    mark_writing(out / "checkpoint-8")  # newer, being written: keep
    deleted = rotate_checkpoints(out, 1)
    assert sorted(_names(deleted)) == ["checkpoint-1", "checkpoint-2", "checkpoint-4"]
    assert _names(list_checkpoints(out)) == ["checkpoint-6", "checkpoint-8"]
    assert rotate_checkpoints(out, 1) == []  # checkpoint-6 is the newest complete one: never deleted


def test_training_with_save_total_limit_and_auto_resume(tmp_path):
    trainer = make_trainer(tmp_path, callbacks=[FaultToleranceCallback()], save_total_limit=1, max_steps=4)
    trainer.train()
    assert _names(list_checkpoints(tmp_path)) == ["checkpoint-4"]
    assert trainer.args.save_total_limit == 1  # never changed
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    # Re-running the same command: resumes at step 4 == max_steps and trains nothing more.
    again = make_trainer(
        tmp_path, callbacks=[FaultToleranceCallback()], save_total_limit=1, max_steps=4, auto_resume=True
    )
    output = again.train()
    assert output.global_step == 4 and _names(list_checkpoints(tmp_path)) == ["checkpoint-4"]
    for key, value in again.model.state_dict().items():
        assert torch.equal(value, weights[key]), key


def test_nan_loss_rolls_back_and_skips_the_data_window(tmp_path, order):
    poisoned_step = 4  # 1-based step whose batch holds the poisoned block
    data = Blocks(poison=(order[poisoned_step - 1][0],))
    model = small_model()
    poison_loss(model)
    seen, _ = record_blocks(model, data)
    callback = FaultToleranceCallback()
    trainer = make_trainer(tmp_path / "run", model=model, data=data, callbacks=[callback], max_steps=8)
    output = trainer.train()
    assert callback.rollbacks == 1 and output.global_step == 8
    # Steps 1-4 ran (the 4th was poisoned), then from checkpoint-2 the window up to step 4 was skipped.
    assert seen == order[:4] + order[4:8]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert verify_checkpoint(tmp_path / "run" / "checkpoint-8") is None
    assert not list((tmp_path / "run").glob("llmkit-rollback-*"))  # the temporary restart point is gone


def test_rollbacks_are_limited_then_fail_clearly(tmp_path, order):
    data = Blocks(poison=(order[2][0], order[4][0]))  # steps 3 and 5
    model = small_model()
    poison_loss(model)
    trainer = make_trainer(
        tmp_path / "run", model=model, data=data, max_steps=8, callbacks=[FaultToleranceCallback(max_rollbacks=1)]
    )
    with pytest.raises(TrainingDivergedError, match="max_rollbacks=1"):
        trainer.train()


def test_loss_spike_rolls_back(tmp_path, order):
    data = Blocks(poison=(order[5][0],))  # step 6
    model = small_model()
    poison_loss(model, factor=20.0)
    callback = FaultToleranceCallback(loss_spike_factor=3.0, loss_spike_warmup_steps=2)
    output = make_trainer(tmp_path / "run", model=model, data=data, callbacks=[callback], max_steps=8).train()
    assert callback.rollbacks == 1 and output.global_step == 8


def test_plain_trainer_stops_with_a_clear_error_on_nan(tmp_path, order):
    model = small_model()
    poison_loss(model)
    trainer = make_trainer(
        tmp_path / "run",
        model=model,
        data=Blocks(poison=(order[3][0],)),
        plain=True,
        callbacks=[FaultToleranceCallback()],
        max_steps=8,
    )
    with pytest.raises(TrainingDivergedError, match="LLMKitTrainer"):
        trainer.train()


class _SendSignal(TrainerCallback):
    def __init__(self, signum: int, at_step: int):
        self.signum, self.at_step = signum, at_step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.at_step:
            os.kill(os.getpid(), self.signum)  # a real signal, delivered to this process


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_saves_at_next_step_and_exits_with_the_configured_code(tmp_path, signum):
    previous = signal.getsignal(signum)
    trainer = make_trainer(
        tmp_path, callbacks=[_SendSignal(signum, 2), FaultToleranceCallback(exit_code=85)], save_steps=100, max_steps=6
    )
    with pytest.raises(SystemExit) as exit_info:
        trainer.train()
    assert exit_info.value.code == 85
    assert signal.getsignal(signum) == previous  # handlers restored
    assert _names(list_checkpoints(tmp_path)) == ["checkpoint-3"]  # the step in flight finished, then saved
    assert verify_checkpoint(tmp_path / "checkpoint-3") is None
    # The requeued job resumes there.
    resumed = make_trainer(
        tmp_path, callbacks=[FaultToleranceCallback()], save_steps=100, max_steps=6, auto_resume=True
    )
    assert resumed.train().global_step == 6


class _FlakyTokenizer:
    """A processing class whose save fails with EIO `failures` times (a flaky network filesystem)."""

    def __init__(self, failures: int, code: int = errno.EIO):
        self.failures, self.code, self.calls = failures, code, 0

    def save_pretrained(self, folder, **kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError(self.code, os.strerror(self.code))
        open(os.path.join(folder, "tokenizer_saved.txt"), "w").close()


def test_transient_io_errors_during_save_are_retried(tmp_path):
    trainer = make_trainer(tmp_path, callbacks=[FaultToleranceCallback()], max_steps=2)
    trainer.processing_class = _FlakyTokenizer(failures=2)
    trainer.train()
    assert trainer.processing_class.calls == 3  # 2 failures, then the successful retry
    assert verify_checkpoint(tmp_path / "checkpoint-2") is None


def test_permanent_io_errors_are_not_retried(tmp_path):
    trainer = make_trainer(tmp_path, callbacks=[FaultToleranceCallback()], max_steps=2)
    trainer.processing_class = _FlakyTokenizer(failures=5, code=errno.EACCES)
    with pytest.raises(CheckpointWriteError, match="permission denied") as error:
        trainer.train()
    assert isinstance(error.value.__cause__, PermissionError) and error.value.code == 74
    assert trainer.processing_class.calls == 1
    assert not (tmp_path / "checkpoint-2").exists()  # our half-written folder is gone


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(signals=("SIGNOPE",)), "unknown signal"),
        (dict(exit_code=300), "exit_code"),
        (dict(max_rollbacks=-1), "max_rollbacks"),
        (dict(loss_spike_factor=0.5), "loss_spike_factor"),
        (dict(loss_ema_decay=1.0), "loss_ema_decay"),
    ],
)
def test_bad_callback_settings_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FaultToleranceCallback(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(save_retries=-1), dict(save_retry_delay=-1.0)])
def test_bad_argument_values_name_the_fix(tmp_path, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        LLMKitTrainingArguments(output_dir=str(tmp_path), **kwargs)


def test_resume_true_without_complete_checkpoint_is_a_clear_error(tmp_path):
    trainer = make_trainer(tmp_path, callbacks=[FaultToleranceCallback()])
    with pytest.raises(ValueError, match="no complete checkpoint"):
        trainer.train(resume_from_checkpoint=True)
