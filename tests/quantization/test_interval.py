"""The interval engine: DKM's closed form between sorted centroids equals naive DKM in float64 (outputs, weight
gradients, refined centroids) on the cases that break closed forms (crowded and equal centroids, outliers far past
the last centroid, weights exactly on a centroid, centroids sharing a grid cell, unsorted tables), and its cost does
not grow with the number of tables."""

from __future__ import annotations

import pytest
import torch

from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.quantization.engines import interval, naive


def _case(kind: str, groups: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(groups * 10 + bits)
    w = torch.randn(groups, 3000, generator=gen, dtype=torch.float64) * 0.02
    c = dkm.kmeans(w.unsqueeze(-1).float(), 1 << bits, 12, 65536)[..., 0].double()
    if kind == "outliers":  # far past the outer centroids (e^-2000 attention in a naive sum of exponentials)
        w[:, :4] = torch.tensor([0.9, -1.3, 2.5, -0.5], dtype=torch.float64)
    elif kind == "on_centroids":
        w[:, : c.shape[1]] = c
    elif kind == "crowded":  # two centroids within a temperature of each other, one pair exactly equal
        c[:, 1] = c[:, 0] + 1e-5
        if c.shape[1] > 3:
            c[:, 3] = c[:, 2]
    elif kind == "unsorted":
        c = c.flip(1)
    return w, c


@pytest.mark.parametrize("kind", ["plain", "outliers", "on_centroids", "crowded", "unsorted"])
@pytest.mark.parametrize("groups, bits", [(1, 1), (1, 3), (6, 4), (3, 2), (2, 8)])
def test_interval_equals_float64_naive_dkm(kind, groups, bits, monkeypatch):
    """Equal to naive DKM of the same distance `|w - c|` (naive smooths it by `DIST_EPS` inside a square root, set
    negligible here; `test_engines.py` compares with the smoothed one)."""
    monkeypatch.setattr(dkm, "DIST_EPS", 1e-60)
    w, c = _case(kind, groups, bits)
    std = w.std(1, unbiased=False)
    tau, eps = 0.02 * std, 1e-9 * std
    w_ref, w_new = w.clone().requires_grad_(), w.clone().requires_grad_()
    out_ref, c_ref = naive.soft_dkm(w_ref.unsqueeze(-1), c.unsqueeze(-1), tau, 3, eps)
    out, c_new = interval.soft_dkm(w_new, c, tau, 3, eps)
    grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (out_ref[..., 0] * grad).sum().backward()
    (out * grad).sum().backward()

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    assert rel(out, out_ref[..., 0]) < 1e-9
    assert rel(c_new, c_ref[..., 0]) < 1e-9
    smooth = torch.ones_like(w, dtype=torch.bool)
    if kind == "on_centroids":  # |w - c| has a kink there: naive takes the zero subgradient, this a one-sided one
        smooth[:, : c.shape[1]] = False
    assert rel(w_new.grad[smooth], w_ref.grad[smooth]) < 1e-8
    assert torch.isfinite(w_new.grad).all()


def test_centroids_sharing_a_cell_are_located_one_by_one():
    """Every weight's interval is the number of centroids below it, also where many centroids share a grid cell."""
    w = torch.linspace(-1, 1, 5001, dtype=torch.float64).unsqueeze(0)
    c = torch.tensor([[-0.5, -0.0004, -0.0002, 0.0, 0.0, 0.0003, 0.7, 1.0]], dtype=torch.float64)
    cells = interval.Cells.of(w)
    got = cells.intervals(w, c)
    assert torch.equal(got, (w.unsqueeze(-1) > c.unsqueeze(1)).sum(-1).int())


def test_the_cost_does_not_grow_with_the_number_of_tables():
    """Saved for backward: the weight (a parameter) and each weight's interval per step (a byte up to 7 bits), plus
    the per-interval tables (`[G, K+1, K]` each, a few per step): nothing `[weights x centroids]`-sized, whatever the
    number of tables."""
    torch.manual_seed(0)
    w = (torch.randn(256, 64) * 0.02).requires_grad_()

    def saved_bytes(groups: int) -> int:
        view = w.reshape(groups, -1)
        c = dkm.kmeans(view.detach().unsqueeze(-1), 16, 4, 65536)[..., 0]
        std = dkm.group_std(view.unsqueeze(-1)).double()
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = interval.soft_dkm(view, c, 0.02 * std, 3, 1e-30 * std)
        out.sum().backward()
        return sum(seen.values())

    per_tensor, per_channel = saved_bytes(1), saved_bytes(256)
    tables = 4 * 256 * 17 * 16  # bytes of one float32 [G, K+1, K] table, G = 256 (a table per channel), K = 16
    assert per_tensor < w.numel() * (4 + 4) + 64 * 1024  # the weight, a one-byte interval per weight and step
    assert per_channel - per_tensor < 4 * 8 * tables  # 3 steps + the output, at most 8 tables each
