"""How a run ends when it cannot finish: diverged, disk full (preemption by SIGTERM is in
tests/callbacks/test_kill_resume_run_clm.py). Each ends with one line, its own exit status and no traceback, and
leaves the last complete checkpoint as it was (issue 11, section 3)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hf_llmkit.callbacks import CheckpointWriteError, verify_checkpoint
from hf_llmkit.checkpoints.retries import describe_write_error
from tests import warm
from tests.conftest import EXAMPLES
from tests.examples.test_run_clm import TINY

HERE = Path(__file__).parent


def _lines(stderr: str, needle: str) -> list[str]:
    return [line for line in stderr.splitlines() if needle in line]


@pytest.mark.slow  # the same exit path as SIGTERM in the main job (tests/callbacks/test_kill_resume_run_clm.py)
def test_divergence_in_the_main_job_is_one_line_and_exit_status_3(tmp_path):
    args = [*TINY, "--output_dir", str(tmp_path)]
    args += ["--max_steps", "6", "--save_steps", "100", "--learning_rate", "1e12", "--max_grad_norm", "0"]
    proc = warm.run_script(EXAMPLES / "run_clm.py", args, timeout=240)  # `python run_clm.py ...`, forked warm
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    [line] = _lines(proc.stderr, "training diverged")
    assert "non-finite training loss at step" in line and "lower the learning rate" in line


def test_a_real_file_size_limit_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    # `python file_limit_run.py OUT` in a process of its own (the limit is the process's), forked from tests/warm.py
    proc = warm.run_script(HERE / "file_limit_run.py", [str(tmp_path)], timeout=240)
    assert proc.returncode == 74, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    [line] = _lines(proc.stderr, "could not write")
    assert "checkpoint-4" in line and "file size limit" in line and "last complete checkpoint is untouched" in line
    assert verify_checkpoint(tmp_path / "checkpoint-2") is None
    assert not (tmp_path / "checkpoint-4").exists()  # our half-written folder is gone


@pytest.mark.skipif(
    not (os.path.exists("/dev/full") and stat.S_ISCHR(os.stat("/dev/full").st_mode)), reason="no /dev/full device"
)
def test_write_errors_from_a_full_device_are_recognised():
    import torch

    # /dev/full answers every write with ENOSPC. (Only writers that open the path in place: a writer that replaces
    # the file by renaming would, run as root, replace the device itself.)
    with pytest.raises(RuntimeError) as torch_error:
        torch.save({"x": torch.zeros(100_000)}, "/dev/full")
    with pytest.raises(OSError) as os_error, open("/dev/full", "wb") as handle:
        handle.write(b"0" * 10_000)
        handle.flush()
    assert "disk may be full" in describe_write_error(torch_error.value, "/tmp")
    assert describe_write_error(os_error.value, "/tmp").startswith("no space left on the device")
    assert "permission denied" in describe_write_error(PermissionError(13, "Permission denied"), "/tmp")
    assert describe_write_error(ValueError("not an I/O error"), "/tmp") is None
    error = CheckpointWriteError("could not write x: disk full")
    assert isinstance(error, RuntimeError) and isinstance(error, SystemExit) and error.code == 74
