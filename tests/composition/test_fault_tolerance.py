"""Fault tolerance x one pair of each row of the composition matrix: the main job (`examples/run_clm.py`) with the
pair's flags, SIGKILLed after its first checkpoint and re-run with the same command, ends with every final artifact
byte-identical to an uninterrupted run. Reuses the kill-and-resume harness of tests/callbacks (one harness process
serves every case). `make test` runs the main job's quick kill-and-resume cases (tests/callbacks); these are slow."""

from __future__ import annotations

import pytest

from tests.callbacks.test_kill_resume_run_clm import _check_same_final_artifacts, _harness
from tests.composition.matrix import FAULT_TOLERANCE
from tests.conftest import REPO


def _absolute(flags: list[str]) -> list[str]:
    """Config files named relative to the repository (the harness runs in its own folder)."""
    return [str(REPO / flag) if flag.startswith("examples/") else flag for flag in flags]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("composition_kill")
    cases = {name: {**case, "flags": _absolute(case["flags"])} for name, case in FAULT_TOLERANCE.items()}
    return workdir, cases, _harness(workdir, cases)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAULT_TOLERANCE))
def test_killed_pair_resumes_to_the_same_final_artifacts(name, killed):
    workdir, cases, results = killed
    _check_same_final_artifacts(name, cases[name], results[name], workdir)
