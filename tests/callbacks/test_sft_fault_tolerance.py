"""Fault tolerance for any Trainer, with TRL's `SFTTrainer` as the client and `FaultToleranceCallback` alone
(issue 19, section 3): a kill -9 in the middle of a checkpoint write, then `train(resume_from_checkpoint=True)`, ends
bitwise equal to an uninterrupted run although transformers' `get_last_checkpoint` names the half-written folder;
SIGTERM saves, exits 143 with one line, and the same script finishes the run bitwise equal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("sft_harness.py")


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> dict:
    command = [sys.executable, str(HARNESS), str(tmp_path_factory.mktemp("sft"))]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["reference_exit"] == 0, result
    return result


def test_sft_trainer_killed_mid_save_resumes_from_the_complete_checkpoint_bitwise(sft):
    killed = sft["killed"]
    assert killed["mid_write"], killed  # the kill landed inside the write of checkpoint-4
    assert killed["get_last_checkpoint"] == "checkpoint-4", killed  # what resume_from_checkpoint=True would take
    assert killed["rerun_exit"] == 0 and killed["rerun"]["resumed_at"] == 2, killed
    assert killed["mismatched"] == [], killed


def test_sft_trainer_sigterm_saves_exits_143_and_the_same_script_finishes_bitwise(sft):
    stopped = sft["sigterm"]
    assert stopped["exit"] == 143 and stopped["tracebacks"] == 0, stopped
    [line] = stopped["stop_lines"]
    assert "received SIGTERM" in line and line.endswith("(exit status 143)"), line
    assert stopped["rerun_exit"] == 0 and stopped["rerun"]["resumed_at"] >= 2, stopped
    assert stopped["mismatched"] == [], stopped
