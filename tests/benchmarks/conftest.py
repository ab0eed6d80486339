"""The benchmark runs the tests of this folder read, each made once per test run (issue 49): every script's `--quick`
mode and the GPU check's CPU plumbing mode. A run is a process of its own, as a user starts it (`python
benchmarks/<script> ...`: the script runs as `__main__`, with its own argv, environment, exit status and output),
forked from the warm interpreter of tests/warm.py instead of a cold `python` (whose imports of torch, transformers and
peft cost 6-7 s of CPU per run); its results go to a folder of this test run (never over benchmarks/results/), and
every test that needs them reads the same files.

Across pytest-xdist's workers (`make test`: two, each test file whole on one of them) the first worker to ask for a
run makes it under a file lock in the run's shared temporary folder; a worker asking meanwhile waits for it, and one
asking later reads it. A run that fails is recorded as failed (its exit code and the end of its output) and not made
again: every test reading it fails with that output. The runs share one hf_llmkit cache (`$HF_LLMKIT_CACHE`), so the
SmolLM2 folders, the corpus tokenizer and the tokenized data are built once for all of them.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import warm
from tests.conftest import run_folder

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


@dataclass(frozen=True)
class Run:
    """A finished benchmark run: its results folder, exit code and the end of its output."""

    folder: Path
    returncode: int
    output: str

    def check(self) -> None:
        assert self.returncode == 0, self.output


def run_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], tuple[int, str]]) -> Run:
    """`make(folder)` (-> exit code, output) run once per test run into `<shared>/runs/<name>`; later callers, in
    this worker or another, get the same `Run`."""
    root = run_folder(tmp_path_factory, "bench_runs")
    folder, done = root / name, root / f"{name}.done.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, whatever happens
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            returncode, output = make(folder)
            done.write_text(json.dumps({"returncode": returncode, "output": output}))
    outcome = json.loads(done.read_text())
    return Run(folder, outcome["returncode"], outcome["output"])


def bench_env(tmp_path_factory: pytest.TempPathFactory, results: Path) -> dict[str, str]:
    """The environment of a benchmark run: results to `results`, one intra-op thread, the runs' shared cache."""
    cache = run_folder(tmp_path_factory, "hf_llmkit_cache")  # the suite's own (tests/conftest.py)
    return dict(os.environ, HF_LLMKIT_BENCH_RESULTS=str(results), HF_LLMKIT_CACHE=str(cache), OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1")  # fmt: skip


def run_script(script: str, args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """`python benchmarks/<script> <args>` from the repository's root, forked from the warm interpreter (a run past
    `timeout` is killed with everything it started: exit status -9)."""
    proc = warm.run_script(BENCHMARKS / script, args, env=env, cwd=REPO, timeout=timeout)
    return proc.returncode, proc.stdout[-3000:] + proc.stderr[-3000:]


QUICK_TIMEOUT_S = 900


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory) -> Callable[[str], Run]:
    """`quick_run("moe.py")`: the script's `python benchmarks/<script> --quick --device cpu`, its results in
    `Run.folder`."""

    def get(script: str) -> Run:
        def make(folder: Path) -> tuple[int, str]:
            args = ["--quick", "--device", "cpu"]
            return run_script(script, args, bench_env(tmp_path_factory, folder), QUICK_TIMEOUT_S)

        return run_once(tmp_path_factory, f"quick-{script[:-3]}", make)

    return get


PLUMBING_TIMEOUT_S = 1800


@pytest.fixture(scope="session")
def plumbing_run(tmp_path_factory) -> Run:
    """`python benchmarks/gpu_check.py --device cpu --out <folder>/out`, its results in `<folder>/results`."""

    def make(folder: Path) -> tuple[int, str]:
        results, out = folder / "results", folder / "out"
        args = ["--device", "cpu", "--out", str(out)]
        return run_script("gpu_check.py", args, bench_env(tmp_path_factory, results), PLUMBING_TIMEOUT_S)

    return run_once(tmp_path_factory, "gpu_check", make)
