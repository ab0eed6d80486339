"""The composition matrix's mixed-precision and TRL cells on CUDA, where accelerate itself makes the fp16
`GradScaler` and the autocast (the CPU matrix gives a CPU accelerator a real `torch.amp.GradScaler("cpu")`,
tests/composition/clients.py): each single-rank bf16 / fp16 / TRL cell trains on the GPU, matches the same autocast
loop on the GPU, and its save reloads (on CPU, in fp32) with the trained model's outputs. Both run under
`torch.use_deterministic_algorithms`: CUDA's atomic float adds (DKM's table engine sums its gradients per table entry)
otherwise make two equal runs differ by more than the 1e-5 the cells are held to.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.composition.cells import reference, reload, train_cell
from tests.composition.matrix import CELLS

pytestmark = pytest.mark.gpu

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS' deterministic mode (read before it starts)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


CUDA_CELLS = [c for c in CELLS if (c.setup.precision or c.setup.trl) and c.setup.ranks == 1 and c.expected == "ok"]


@pytest.mark.parametrize("cell", CUDA_CELLS, ids=lambda c: c.name)
def test_amp_and_trl_cells_on_cuda_match_the_same_autocast_loop(cell, tmp_path):
    result = train_cell(cell.setup, tmp_path / cell.name, str(tmp_path), device="cuda")
    losses = result["losses"]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    if cell.setup.precision == "fp16":
        assert result["scale"] is not None  # accelerate's own GradScaler (the CPU one is never installed on CUDA)
    else:
        assert result["scale"] is None
    ref_losses, ref_logits = reference(cell.setup, str(tmp_path), device="cuda")
    assert losses == pytest.approx(ref_losses, abs=1e-5), "the losses differ from the same autocast loop"
    torch.testing.assert_close(result["logits"], ref_logits, atol=1e-5, rtol=0)
    reloaded = reload(cell.setup, str(tmp_path), result["saved"])  # CPU kernels against CUDA ones, in fp32
    torch.testing.assert_close(reloaded, result["logits"], atol=1e-4, rtol=1e-4, msg="reload changed outputs")
