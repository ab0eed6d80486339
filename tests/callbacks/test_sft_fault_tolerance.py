"""Fault tolerance for any Trainer, with TRL's `SFTTrainer` as the client and `FaultToleranceCallback` alone
(issue 19, section 3): a kill -9 in the middle of a checkpoint write, then `train(resume_from_checkpoint=True)`, ends
bitwise equal to an uninterrupted run although transformers' `get_last_checkpoint` names the half-written folder;
SIGTERM saves, exits 143 with one line, and the same script finishes the run bitwise equal."""

from __future__ import annotations

import pytest

from tests import warm


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> dict:
    # The harness (`python tests/callbacks/sft_harness.py WORKDIR`) as a function, in a child of the warm interpreter
    # (tests/warm.py): it forks every attempt from there, as from its own process.
    result = warm.call("tests.callbacks.sft_harness:run", tmp_path_factory.mktemp("sft"), 0, timeout=400)
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
