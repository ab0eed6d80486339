"""Fault tolerance next to the Trainer's own checkpoint features: `enable_jit_checkpoint` (refused with our SIGTERM
handler, coexisting with our SIGUSR1 one), the handlers put back after `train()` (a SIGTERM then ends the process),
the JIT checkpoint's incomplete marker, and model-only (`save_only_model`) checkpoints on resume."""

from __future__ import annotations

import inspect
import logging
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from transformers import TrainerCallback

from hf_llmkit.callbacks import FaultToleranceCallback, latest_complete_checkpoint
from hf_llmkit.checkpoints import ResumeError
from hf_llmkit.checkpoints.names import JIT_INCOMPLETE_MARKER, MANIFEST_NAME
from hf_llmkit.checkpoints.status import CheckpointState, classify_checkpoint
from tests.callbacks.support import make_trainer
from tests.conftest import REPO


@pytest.fixture
def sigterm_restored():
    """transformers' JIT callback installs its SIGTERM handler when the Trainer is built: put pytest's back."""
    previous = signal.getsignal(signal.SIGTERM)
    yield previous
    signal.signal(signal.SIGTERM, previous)


def test_jit_checkpoint_and_our_sigterm_handler_are_refused_before_any_work(tmp_path, sigterm_restored):
    with pytest.raises(ValueError) as refused:
        make_trainer(tmp_path, callbacks=[FaultToleranceCallback()], enable_jit_checkpoint=True)
    message = str(refused.value)
    assert "\n" not in message and "enable_jit_checkpoint=True" in message and "FaultToleranceCallback" in message
    assert "signals=('SIGUSR1',)" in message and not list(tmp_path.glob("checkpoint-*"))


def test_jit_checkpoint_keeps_sigterm_when_we_listen_to_sigusr1_and_both_handlers_come_back(
    tmp_path, sigterm_restored
):
    usr1 = signal.getsignal(signal.SIGUSR1)
    callback = FaultToleranceCallback(signals=("SIGUSR1",))
    trainer = make_trainer(tmp_path, callbacks=[callback], enable_jit_checkpoint=True, max_steps=2)
    trainer.train()
    assert signal.getsignal(signal.SIGTERM) == sigterm_restored  # the JIT callback put back what it replaced
    assert signal.getsignal(signal.SIGUSR1) == usr1  # and so did ours


SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from transformers import TrainerCallback
    from hf_llmkit.callbacks import FaultToleranceCallback
    from tests.callbacks.support import make_trainer

    class OwnSigterm(TrainerCallback):
        # a component that installs its SIGTERM handler after ours and puts back what it found (ours) after ours
        def on_train_begin(self, args, state, control, **kwargs):
            self.previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        def on_train_end(self, args, state, control, **kwargs):
            signal.signal(signal.SIGTERM, self.previous)

    make_trainer(sys.argv[1], callbacks=[FaultToleranceCallback(), OwnSigterm()], max_steps=2).train()
    print("trained", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(20)
    print("still alive", flush=True)
""")


def test_sigterm_after_train_ends_the_process(tmp_path):
    """After `train()` our handler, still installed by a component that restored it, passes SIGTERM on to the
    default action: the process ends (it used to swallow the signal and live on)."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert "trained" in proc.stdout and "still alive" not in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == -signal.SIGTERM and time.monotonic() - started < 100


def test_the_jit_checkpoints_incomplete_marker_makes_a_checkpoint_interrupted(tmp_path):
    import transformers.trainer_jit_checkpoint as jit

    assert f'"{JIT_INCOMPLETE_MARKER}"' in inspect.getsource(jit)  # transformers' own name for it
    make_trainer(tmp_path, callbacks=[FaultToleranceCallback()], max_steps=4).train()
    newest = tmp_path / "checkpoint-4"
    (newest / MANIFEST_NAME).unlink()  # as if the JIT save of step 4 was cut: no manifest, the marker left
    (newest / JIT_INCOMPLETE_MARKER).write_text("Checkpoint started at step 4 and in progress...")
    verdict = classify_checkpoint(newest)
    assert verdict.state is CheckpointState.INTERRUPTED and JIT_INCOMPLETE_MARKER in verdict.reason
    assert latest_complete_checkpoint(tmp_path).endswith("checkpoint-2")
    resumed = make_trainer(tmp_path, callbacks=[FaultToleranceCallback()], max_steps=4, auto_resume=True)
    assert resumed.train().global_step == 4 and resumed.resumed_from.endswith("checkpoint-2")


class _FirstRate(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.rate = getattr(self, "rate", optimizer.param_groups[0]["lr"])


def test_a_model_only_checkpoint_resumes_with_one_line_or_is_refused_for_an_exact_resumption(tmp_path, caplog):
    make_trainer(tmp_path, callbacks=[FaultToleranceCallback()], max_steps=2, save_only_model=True).train()
    assert not list((tmp_path / "checkpoint-2").glob("optimizer*"))
    exact = make_trainer(tmp_path, callbacks=[FaultToleranceCallback()], max_steps=4, auto_resume=True)
    with pytest.raises(ResumeError) as refused:
        exact.train()
    message = str(refused.value)
    assert "\n" not in message and "holds the model only (saved with save_only_model=True)" in message
    assert "--save_only_model true" in message and exact.state.global_step == 0
    first = _FirstRate()
    accepted = make_trainer(
        tmp_path, callbacks=[FaultToleranceCallback(), first], max_steps=4, auto_resume=True, save_only_model=True,
        warmup_steps=0,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hf_llmkit"):
        assert accepted.train().global_step == 4
    [line] = [r.getMessage() for r in caplog.records if "model-only checkpoint" in r.getMessage()]
    assert "the optimizer and the learning-rate schedule restart fresh" in line and "\n" not in line
    assert first.rate == pytest.approx(5e-3)  # the schedule started over: the peak rate, not step 3's
