"""FaultToleranceCallback's resumable state goes through `ExportableState`, it asks through `control` and ends a
stopped run by raising (under a plain Trainer too), it never touches the arguments, and a plain Trainer with it never
resumes from a half-written checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from hf_llmkit.callbacks import FaultToleranceCallback, TrainingInterrupted, verify_checkpoint
from hf_llmkit.checkpoints import ResumeError
from hf_llmkit.checkpoints.manifest import mark_writing
from hf_llmkit.checkpoints.names import MANIFEST_NAME
from tests.callbacks.support import Blocks, data_order, make_trainer, poison_loss, small_model


def test_state_round_trips_through_from_state():
    callback = FaultToleranceCallback(max_rollbacks=5, loss_spike_factor=3.0, exit_code=99, signals=["SIGUSR1"])
    callback.rollbacks, callback.loss_ema, callback.good_steps = 2, 1.5, 7
    restored = FaultToleranceCallback.from_state(json.loads(json.dumps(callback.state())))
    assert restored.state() == callback.state()
    assert (restored.rollbacks, restored.watch.ema, restored.watch.good_steps, restored.exit_code) == (2, 1.5, 7, 99)


def test_the_rollback_count_survives_a_resume(tmp_path):
    order = data_order(tmp_path, steps=8)
    model = small_model()
    poison_loss(model)
    callback = FaultToleranceCallback()
    data = Blocks(poison=(order[2][0],))  # step 3: rolled back to checkpoint-2
    make_trainer(
        tmp_path / "run", model=model, data=data, callbacks=[callback], max_steps=6, save_total_limit=1
    ).train()
    assert callback.rollbacks == 1
    saved = json.loads((tmp_path / "run" / "checkpoint-6" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["FaultToleranceCallback"]["attributes"]["rollbacks"] == 1
    again = FaultToleranceCallback()  # a restarted job: a fresh callback, the count comes from the checkpoint
    make_trainer(tmp_path / "run", callbacks=[again], max_steps=8, auto_resume=True).train()
    assert again.rollbacks == 1


class _SendSigterm(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


def test_with_a_plain_trainer_sigterm_ends_the_run_with_143_after_the_checkpoint(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    trainer = make_trainer(
        tmp_path, plain=True, callbacks=[_SendSigterm(), FaultToleranceCallback()], save_steps=100, save_total_limit=3
    )
    with pytest.raises(TrainingInterrupted, match="stopped at step 3 after saving the complete checkpoint") as error:
        trainer.train()
    assert error.value.code == 143 and isinstance(error.value, SystemExit)
    assert signal.getsignal(signal.SIGTERM) == previous
    assert (tmp_path / "checkpoint-3" / "llmkit_manifest.json").is_file()
    assert trainer.args.save_total_limit == 3  # the callback never changes the arguments


def test_rollback_also_works_when_the_trainer_restores_callback_states(tmp_path):
    """With `restore_callback_states_from_checkpoint`, the Trainer replaces the callback and the control objects on
    resume; the rollback request and count still arrive."""
    order = data_order(tmp_path, steps=8)
    model = small_model()
    poison_loss(model)
    trainer = make_trainer(
        tmp_path / "run",
        model=model,
        data=Blocks(poison=(order[2][0], order[5][0])),  # steps 3 and 6: the second request comes after a resume
        callbacks=[FaultToleranceCallback()],
        max_steps=8,
        restore_callback_states_from_checkpoint=True,
    )
    assert trainer.train().global_step == 8
    [live] = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, FaultToleranceCallback)]
    assert live.rollbacks == 2


def test_a_plain_trainer_never_resumes_from_a_half_written_checkpoint(tmp_path):
    """`resume_from_checkpoint=True` takes the highest `checkpoint-N`: the callback clears half-written ones from
    the top when the Trainer is built, and refuses one the Trainer was given explicitly, naming the complete one."""
    make_trainer(tmp_path, plain=True, callbacks=[FaultToleranceCallback()], max_steps=4).train()
    shutil.copytree(tmp_path / "checkpoint-4", tmp_path / "checkpoint-6")  # killed while writing checkpoint-6
    (tmp_path / "checkpoint-6" / MANIFEST_NAME).unlink()
    (tmp_path / "checkpoint-6" / "trainer_state.json").unlink()
    mark_writing(tmp_path / "checkpoint-6")
    assert get_last_checkpoint(str(tmp_path)).endswith("checkpoint-6")  # what the Trainer alone would resume
    trainer = make_trainer(tmp_path, plain=True, callbacks=[FaultToleranceCallback()], max_steps=6)
    assert not (tmp_path / "checkpoint-6").exists()  # our interrupted write, gone when the Trainer was built
    trainer.train(resume_from_checkpoint=True)
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [1, 2, 3, 4, 5, 6]
    assert verify_checkpoint(tmp_path / "checkpoint-6") is None

    (tmp_path / "checkpoint-2" / MANIFEST_NAME).unlink()
    mark_writing(tmp_path / "checkpoint-2")  # an older half-written folder, named explicitly
    trainer = make_trainer(tmp_path, plain=True, callbacks=[FaultToleranceCallback()], max_steps=8)
    with pytest.raises(ResumeError, match="resumed from checkpoint-2 is interrupted") as error:
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    message = str(error.value)
    assert f"resume from {tmp_path / 'checkpoint-6'}, the latest complete" in message and "\n" not in message
    assert error.value.code == 2 and sorted(p.name for p in tmp_path.glob("checkpoint-*"))[-1] == "checkpoint-6"
