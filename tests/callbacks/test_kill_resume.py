"""SIGKILL a real training run at 12 random moments (half of them inside checkpoint writes), resume each time with
the same command, and require the final weights to be bitwise identical to an uninterrupted run."""

from __future__ import annotations

from tests import warm


def test_killed_and_resumed_run_matches_uninterrupted_run(tmp_path):
    # The harness (`python tests/callbacks/kill_harness.py WORKDIR --kills 12 --seed 0`) as a function, in a child of
    # the warm interpreter (tests/warm.py): it forks every attempt from there, as from its own process.
    result = warm.call("tests.callbacks.kill_harness:run", tmp_path, 12, 0, timeout=400)
    attempts = result["attempts"]
    killed = [a for a in attempts if a["killed"]]
    assert len(killed) >= 10, attempts
    # Kills landed inside writes: the newest folder was left without a manifest and resume skipped it.
    mid_write = [a for a in killed if a["newest_folder_after"] != a["latest_complete_after"]]
    assert mid_write, attempts
    # Every attempt after the first resumed from a complete checkpoint, and progress was never lost.
    steps = [int(a["resumed_from"].split("-")[1]) for a in attempts[1:] if a["resumed_from"]]
    assert steps == sorted(steps) and steps, attempts
    assert result["final_run_ok"]
    assert result["bitwise_mismatched"] == [], result
