"""Shared pytest setup: hermetic caches, no network, quiet threads; fixtures for the example scripts."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

# Nothing in the suite may reach the Hub; subprocesses inherit these.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

# One intra-op thread in this process and every process it starts (`hf_llmkit.testing.launch` passes it on): the
# suite compares outputs bitwise across processes (a fresh interpreter's reload, a launched rank's training against
# its single-rank reference), and a float reduction split over another number of threads rounds differently. On a
# shared 2-core machine OpenMP's spinning threads also made small kernels many times slower than one thread.
os.environ["OMP_NUM_THREADS"] = "1"

# No test may JIT-compile a C++ op (DeepSpeed's CPU Adam or shm collectives): on a fresh 2-core machine a build
# takes minutes, and one killed half way leaves a lock that hangs every later build. The extensions folder is a
# plain file, so any build attempt, in this process or a rank it starts, fails at once with this file's name.
_NO_BUILDS = Path(tempfile.mkdtemp(prefix="hf_llmkit_tests_")) / "jit-op-builds-are-not-allowed-in-tests"
_NO_BUILDS.write_text("tests/conftest.py: a test tried to JIT-compile a torch / DeepSpeed C++ op\n")
atexit.register(shutil.rmtree, _NO_BUILDS.parent, ignore_errors=True)  # every pytest process made one: leave none
os.environ["TORCH_EXTENSIONS_DIR"] = str(_NO_BUILDS)


def pytest_configure(config):
    import torch

    torch.set_num_threads(1)


# The files that take longest, longest first: `make test` hands files to its two workers in collection order
# (`--no-loadscope-reorder`), so these start first and the workers end together instead of one of them starting
# the longest file last. Rough CPU seconds on 2 cores (the durations `pytest --durations` prints); the rest follow
# in their usual order.
LONGEST_FIRST = (
    "tests/docs/test_run_other_pages.py",
    "tests/docs/test_run_main_job.py",
    "tests/composition/test_matrix.py",
    "tests/benchmarks/test_quick_modes.py",
    "tests/quantization/test_export_onnx.py",
    "tests/examples/test_run_clm_multinode.py",
    "tests/callbacks/test_kill_resume_run_clm.py",
)

# Files whose tests mostly read a run another file makes (the GPU check's plumbing run: test_quick_modes.py's first
# case makes it): last, so that their worker does not wait for it under its lock while the other makes it
READERS_LAST = ("tests/benchmarks/test_gpu_check.py",)


def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST_FIRST); tests marked `gpu` (`make test-gpu`) skip, with the reason, on a
    machine without a CUDA device."""
    import torch

    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    rank.update({path: len(rank) + 1 + i for i, path in enumerate(READERS_LAST)})
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FIRST)))  # stable: the rest keep
    # their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False): `make test-gpu` on one")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a keyword: a checkout in a folder named
            item.add_marker(skip)  # gpu would make every test's keywords hold "gpu"


@pytest.fixture(scope="session", autouse=True)
def hermetic_cache(tmp_path_factory):
    """Tokenizers, processed datasets, the SmolLM2 folders and compiled kernels built by the suite go to a folder of
    this test run (not the user's cache), one for both xdist workers: what one builds the other reuses (every cache
    entry is published by an atomic rename, so two builders at once keep one copy)."""
    folder = run_folder(tmp_path_factory, "hf_llmkit_cache")
    with _environ("HF_LLMKIT_CACHE", str(folder)):
        yield folder


def run_folder(tmp_path_factory, name: str) -> Path:
    """A folder shared by every xdist worker of this run (one per run, not per worker); this process's own basetemp
    when there are no workers (the parent of a lone run's basetemp is shared with other runs)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> Path:
    """A folder of runs made once per pytest run and read by every test that asserts on them, of either xdist
    worker (tests/docs/runner.py: shared_run)."""
    return run_folder(tmp_path_factory, "shared-runs")


@pytest.fixture(scope="session", autouse=True)
def hermetic_bench_results(tmp_path_factory):
    """Benchmarks the suite runs (quick modes, the docs' `python benchmarks/...` commands) write their results to a
    per-session folder, never over the committed benchmarks/results/ the docs are generated from."""
    folder = tmp_path_factory.mktemp("bench_results")
    with _environ("HF_LLMKIT_BENCH_RESULTS", str(folder)):
        yield folder


@contextlib.contextmanager
def _environ(name: str, value: str):
    """`os.environ[name] = value` inside the block, the previous value (or none) restored after."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def load_example(name: str):
    """Import `examples/<name>.py` as a module (the examples folder is not a package)."""
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def run_clm():
    return load_example("run_clm")


C_KERNEL_MODULES = (  # every module of the package that holds a C kernel (`hf_llmkit.native.CLibrary`) as `_KERNEL`
    "hf_llmkit.quantization._lut_native",
    "hf_llmkit.quantization.engines.interval_kernel",
    "hf_llmkit.parallel.moe.swiglu_kernel",
    "hf_llmkit.parallel.moe.dispatch",
)


@pytest.fixture
def without_a_c_compiler(tmp_path, monkeypatch):
    """This process as a new one on a machine without a C compiler, in place of a fresh interpreter (6-7 s of CPU
    to import hf_llmkit): `$CC` names nothing that runs, the hf_llmkit cache is empty (the folder returned), and each
    C kernel of the package is an unbuilt copy of itself, so its first use tries to build, fails and logs its one
    line, as in a new process. The kernels built before are back after the test."""
    import copy

    from hf_llmkit.native import CLibrary

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("HF_LLMKIT_CACHE", str(tmp_path / "cache"))
    modules = [importlib.import_module(name) for name in C_KERNEL_MODULES]
    unlisted = [m.__name__ for m in list(sys.modules.values())
                if isinstance(getattr(m, "_KERNEL", None), CLibrary) and m not in modules]  # fmt: skip
    assert not unlisted, f"add {unlisted} to tests/conftest.py's C_KERNEL_MODULES"
    for module in modules:
        unbuilt = copy.copy(module._KERNEL)
        unbuilt._lib, unbuilt._error = None, None  # not tried yet
        monkeypatch.setattr(module, "_KERNEL", unbuilt)
    return tmp_path / "cache"
