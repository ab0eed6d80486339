"""One run per output folder, with two real processes (issue 21, section 1): while one process holds the folder, the
main jobs (run_clm.py, run_sft.py) into it stop before any work with one line naming the holder, a Trainer with
`FaultToleranceCallback` and `LLMKitTrainer` are refused too, and the checkpoint the holder is writing stays
untouched; once the holder is killed (-9), its stale lock is taken over without a word."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys

import pytest

from hf_llmkit.callbacks import FaultToleranceCallback
from hf_llmkit.checkpoints.lock import OutputDirInUse, hold_output_dir, lock_holder
from hf_llmkit.checkpoints.names import LOCK_FILE, WRITING_MARKER
from tests.callbacks.support import make_trainer
from tests.conftest import REPO, load_example
from tests.examples.test_run_clm import TINY
from tests.examples.test_run_sft import TINY as SFT_TINY

HOLDER = """
import sys
from hf_llmkit.checkpoints.lock import hold_output_dir
from hf_llmkit.checkpoints.manifest import mark_writing
handle = hold_output_dir(sys.argv[1])
mark_writing(sys.argv[1] + "/checkpoint-3")  # a checkpoint this run is writing
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_run_into_a_held_folder_stops_before_any_work_and_a_dead_holder_is_taken_over(
    tmp_path, tmp_path_factory, holder, run_clm, monkeypatch, caplog
):
    writing = tmp_path / "checkpoint-3"
    before = sorted(p.name for p in tmp_path.iterdir())
    cache = tmp_path_factory.mktemp("cache")  # its own: the suite's cache is shared with the other xdist worker
    monkeypatch.setenv("HF_LLMKIT_CACHE", str(cache))
    blocks_before = sorted(cache.rglob("lm-blocks-*"))
    with pytest.raises(run_clm.UsageError) as error:  # the main job: one line and exit status 2 from `main()`
        run_clm.run([*TINY, "--output_dir", str(tmp_path)])
    line = str(error.value)
    assert isinstance(error.value.__cause__, OutputDirInUse) and "\n" not in line
    assert f"host {socket.gethostname()}, pid {holder.pid}, started 20" in line, line
    assert "let that run finish or stop it, or pass another --output_dir" in line
    assert sorted(cache.rglob("lm-blocks-*")) == blocks_before  # nothing tokenized
    run_sft = load_example("run_sft")  # the other main job: the same flow (hf_llmkit.cli.job.run_job)
    with pytest.raises(run_sft.UsageError, match=f"pid {holder.pid}") as error:
        run_sft.run([*SFT_TINY, "--max_steps", "2", "--output_dir", str(tmp_path)])
    assert isinstance(error.value.__cause__, OutputDirInUse)
    # In this process: a Trainer with the callback is refused when built, LLMKitTrainer when it trains.
    with pytest.raises(OutputDirInUse, match=f"pid {holder.pid}"):
        make_trainer(tmp_path, plain=True, callbacks=[FaultToleranceCallback()])
    trainer = make_trainer(tmp_path, max_steps=2)
    with pytest.raises(OutputDirInUse) as error:
        trainer.train()
    assert error.value.code == 2 and trainer.state.global_step == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # the holder's checkpoint-3 is untouched
    assert (writing / WRITING_MARKER).is_file()

    holder.send_signal(signal.SIGKILL)
    holder.wait()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_llmkit"):
        handle = hold_output_dir(tmp_path)
    assert handle.held and not caplog.records  # taken over without a word
    assert lock_holder(tmp_path)["pid"] == os.getpid()
    assert hold_output_dir(tmp_path).held  # shared within the process
    handle.release()


def test_the_lock_leaves_unwritable_folders_to_the_writability_checks(tmp_path):
    target = tmp_path / "file"
    target.write_text("not a folder")
    assert not hold_output_dir(target).held
    assert not (tmp_path / LOCK_FILE).exists()
    handle = hold_output_dir(tmp_path / "new" / "out")  # created on the way
    assert handle.held and (tmp_path / "new" / "out" / LOCK_FILE).is_file()
    handle.release()
    assert (tmp_path / "new" / "out" / LOCK_FILE).is_file()  # the record stays: the folder belongs to the run


def test_a_run_rejected_before_any_work_leaves_no_folder_behind(tmp_path):
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "checkpoint-2").mkdir()
    for folder in (tmp_path / "new" / "out", kept):
        handle = hold_output_dir(folder)
        hold_output_dir(folder).release(clean=True)  # another share: the lock stays
        assert handle.held and (folder / LOCK_FILE).is_file()
        handle.release(clean=True)
        assert not handle.held and not (folder / LOCK_FILE).exists()
    assert list(tmp_path.iterdir()) == [kept] and [p.name for p in kept.iterdir()] == ["checkpoint-2"]
