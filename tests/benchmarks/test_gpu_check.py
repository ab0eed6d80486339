"""The GPU check (`benchmarks/gpu_check.py`, `make gpu-check`): its CPU plumbing mode runs every part with the GPU
run's flags at tiny sizes and renders every CUDA table of docs/gpu.md from what it wrote; a part past its budget is
stopped and recorded, and the next part still runs; results on CUDA go beside the CPU files, never over them."""

from __future__ import annotations

import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402
import report  # noqa: E402
from areas.catalog import CUDA_VARIANTS, FRAGMENTS  # noqa: E402
from harness import common  # noqa: E402

COMMITTED = sorted(p.name for p in (BENCHMARKS / "results").iterdir())  # before any run of this test run


@pytest.mark.slow
@pytest.mark.timeout(1800)  # every part in a row: about 4 minutes on 2 idle cores, 11 on 2 cores loaded 5x
def test_plumbing_mode_runs_every_part_and_renders_every_cuda_table(plumbing_run):
    """The run is tests/benchmarks/conftest.py's, made once per test run: test_quick_modes.py reads the results of
    the parts that pass `--quick` as those scripts' quick runs."""
    results, out = plumbing_run.folder / "results", plumbing_run.folder / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert plumbing_run.returncode == 0, plumbing_run.output + json.dumps(summary, indent=2)
    assert list(summary["parts"]) == [part.name for part in gpu_check.PARTS]
    assert {row["status"] for row in summary["parts"].values()} <= {"ok", "skipped"}
    for name in gpu_check.BENCHMARKS:
        data = json.loads((results / f"{name}.cuda.json").read_text())
        assert data["recorded"]["command"].startswith(f"python benchmarks/{name}.py --device cpu")
    rendered = (out / "report.log").read_text()
    for name in ["gpu_check", *CUDA_VARIANTS]:
        assert f"## {name}.cuda\n" in rendered
    assert "_Not measured yet" not in rendered and "_Measured " in rendered
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = tar.getnames()
    assert "benchmarks/results/moe.cuda.json" in names and "docs/gpu.md" in names
    assert "outputs/gpu_check/summary.json" in names and "outputs/gpu_check/moe.log" in names
    assert sorted(p.name for p in (BENCHMARKS / "results").iterdir()) == COMMITTED  # the committed folder untouched


def test_a_part_past_its_budget_is_stopped_with_its_children_and_recorded(tmp_path):
    # a child that would outlive its parent: killing the process group stops both
    cmd = ["bash", "-c", "sleep 30 & sleep 30; echo never"]
    status, seconds = gpu_check.run_part(cmd, tmp_path / "slow.log", 1.0, dict(os.environ))
    assert status == "timeout" and seconds < 10
    assert "stopped after 1 s" in (tmp_path / "slow.log").read_text()
    status, _ = gpu_check.run_part(["bash", "-c", "exit 3"], tmp_path / "bad.log", 10.0, dict(os.environ))
    assert status == "failed (exit 3)"


def test_every_cuda_fragment_is_on_the_gpu_page_and_reads_cuda_results():
    page = BENCHMARKS.parent / "docs" / "gpu.md"
    names = {region.name for region in report.regions(page)}
    assert {"gpu_check.cuda", *(f"{name}.cuda" for name in CUDA_VARIANTS)} <= names
    for name in CUDA_VARIANTS:
        assert FRAGMENTS[f"{name}.cuda"].files == tuple(f"{file}.cuda" for file in FRAGMENTS[name].files)


def test_a_cuda_run_writes_beside_the_cpu_results(monkeypatch):
    monkeypatch.delenv("HF_LLMKIT_BENCH_TAG", raising=False)
    monkeypatch.setattr(common, "_PICKED", {})
    assert common.results_name("moe") == "moe"
    common.pick_device("cpu")
    assert common.results_name("moe") == "moe"
    monkeypatch.setitem(common._PICKED, "device", "cuda")
    assert common.results_name("moe") == "moe.cuda"


def test_gpu_check_refuses_cuda_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert gpu_check.main(["--device", "cuda", "--out", "unused"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err
