"""benchmarks/sequence_parallel.py on a CPU-only torch build (issue 52): transformers' `offload=True` pins host memory
there, which raises at the first checkpointed layer, so its offload-bytes row says why it did not run and the other
designs are measured; where transformers' offload runs (a build that names an accelerator) it is measured."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import sequence_parallel  # noqa: E402

TRANSFORMERS, OURS = list(sequence_parallel.OFFLOAD_DESIGNS)[0], list(sequence_parallel.OFFLOAD_DESIGNS)[2]


@pytest.mark.parametrize("build", ["cpu-only", "this"])
def test_offload_rows_on_a_build_without_pinned_memory_say_why(build, monkeypatch):
    if build == "cpu-only":  # what a CPU-only torch build reports
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    runs = sequence_parallel.transformers_offload_runs()
    rows = sequence_parallel.offload_bytes(64, torch.device("cpu"))["designs"]
    assert rows[OURS]["bytes"] > 0
    if runs:
        assert rows[TRANSFORMERS]["bytes"] > 0
    else:
        assert build == "cpu-only" or torch.accelerator.current_accelerator() is None
        assert "pinned host memory" in rows[TRANSFORMERS]["error"] and "bytes" not in rows[TRANSFORMERS]
