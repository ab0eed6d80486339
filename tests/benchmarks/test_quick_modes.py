"""Every benchmark script's `--quick` mode runs to completion on CPU (`--device cpu`, the same code that runs on
CUDA with `--device cuda`) and writes its JSON; results go to a temporary folder ($HF_LLMKIT_BENCH_RESULTS).

dkm.py stays in `make test` as the representative (seconds); the others take tens of seconds to minutes on 2 busy
cores and are marked slow (`make test-all`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

CASES = [
    pytest.param("dkm.py", "dkm.json", id="dkm"),
    pytest.param("dkm_quality.py", "dkm_quality.json", id="dkm_quality"),  # needs benchmarks/install_peers.sh
    pytest.param("moe.py", "moe.json", id="moe", marks=pytest.mark.slow),
    pytest.param("callbacks.py", "callbacks.json", id="callbacks", marks=pytest.mark.slow),
    pytest.param("peft_methods.py", "peft_methods.json", id="peft_methods", marks=pytest.mark.slow),
    pytest.param("quickstart.py", "quickstart.json", id="quickstart", marks=pytest.mark.slow),
    pytest.param("sequence_parallel.py", "sequence_parallel.json", id="sequence_parallel", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("script", "written"), CASES)
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
    assert json.loads((tmp_path / written).read_text())
