"""Every benchmark script's `--quick` mode runs to completion on CPU (`--device cpu`, the same code that runs on
CUDA with `--device cuda`) and writes its JSON with the run's date, machine and load, from which every docs
fragment of that script renders (benchmarks/report.py); results go to a temporary folder
($HF_LLMKIT_BENCH_RESULTS). The scripts are the ones `make bench` runs: files in benchmarks/ not starting with `_`
that have a `__main__` block, except the three in NOT_RUN_ALONE.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import report  # noqa: E402

NOT_RUN_ALONE = {
    "adapterhub_peer.py": "peft_methods.py runs it inside the AdapterHub virtual environment, with a JSON spec",
    "ci_time.py": "a fresh-clone CI run: ~25 minutes of every core, run alone (no --quick, no --device)",
    "report.py": "not a measurement: renders the docs' regions from the results files",
    "gpu_check.py": "runs the others on a GPU; its CPU plumbing mode: tests/benchmarks/test_gpu_check.py",
}

# dkm.py, dkm_quality.py and lm_data_memory.py take seconds; the others tens of seconds to minutes on 2 busy cores
# (marked slow: `make test` runs them, `make test-fast` does not)
CASES = {
    "dkm.py": ("dkm.json", ()),
    "dkm_quality.py": ("dkm_quality.json", ()),  # the peers: benchmarks/install_peers.sh
    "dkm_inference.py": ("dkm_inference.json", pytest.mark.slow),  # a fresh process per variant and round
    "dkm_onnx.py": ("dkm_onnx.json", pytest.mark.slow),  # two exports, a fresh process per variant
    "lm_data_memory.py": ("lm_data_memory.json", ()),  # one 8 MB line
    "moe.py": ("moe.json", pytest.mark.slow),
    "callbacks.py": ("callbacks.json", pytest.mark.slow),
    "peft_methods.py": ("peft_methods.json", pytest.mark.slow),
    "quickstart.py": ("quickstart.json", pytest.mark.slow),
    "sequence_parallel.py": ("sequence_parallel.json", pytest.mark.slow),
}


def check_dkm_inference(data: dict) -> None:
    """Ours ran through the compact `PalettizedLinear` layers; every other variant ran or records why not (a peer
    that is not installed is a row with its reason)."""
    summary = data["sizes"]["tiny"]["threads"]["1"]["summary"]
    ours = {name: row for name, row in summary.items() if name.startswith("ours")}
    assert ours and all(row["module"] == "PalettizedLinear" for row in ours.values()), ours
    assert all(row["decoder_weights_x_bf16"] < 0.5 for row in ours.values()), ours
    for name, row in summary.items():
        assert ("error" in row and row["error"].strip()) or row["tokens_per_s_b1"] > 0, (name, row)
    assert summary["dense bf16"]["decoder_weights_x_bf16"] == 1.0
    assert any(line.startswith("[tiny, 1 thread] 3-bit") for line in data["verdicts"]), data["verdicts"]


CHECKS = {"dkm_inference.py": check_dkm_inference}  # what a script's quick results must show beyond the common


def entry_points() -> set[str]:
    """The benchmark scripts, found as `make bench` finds them."""
    scripts = {p.name for p in BENCHMARKS.glob("[!_]*.py") if '\nif __name__ == "__main__":' in p.read_text()}
    return scripts - set(NOT_RUN_ALONE)


def test_every_benchmark_script_has_a_quick_mode_case_and_make_bench_finds_them_the_same_way():
    assert entry_points() == set(CASES)
    makefile = (BENCHMARKS.parent / "Makefile").read_text()
    recipe = makefile[makefile.index("\nbench:") :].split("\n\n")[0]
    assert "grep -l '^if __name__ == \"__main__\":' benchmarks/[!_]*.py" in recipe
    assert all(name in recipe for name in NOT_RUN_ALONE)


@pytest.mark.parametrize(
    ("script", "written"),
    [pytest.param(script, written, id=script[:-3], marks=marks) for script, (written, marks) in CASES.items()],
)
def test_quick_mode_runs_to_completion_on_cpu(tmp_path, script, written):
    env = dict(os.environ, HF_LLMKIT_BENCH_RESULTS=str(tmp_path), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", "--device", "cpu"],
        cwd=BENCHMARKS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / written).read_text())
    recorded = data["recorded"]
    assert recorded["command"] == f"python benchmarks/{script} --quick --device cpu"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", recorded["date"])
    assert recorded["machine"]["cores"] and recorded["load_1min"]["max"] >= 0
    CHECKS.get(script, lambda data: None)(data)
    # every docs fragment made from this script's results renders from what the script writes today
    for name, fragment in report.FRAGMENTS.items():
        if fragment.files == (written[: -len(".json")],):
            assert "_Measured " in report.render(name, results=tmp_path), name
