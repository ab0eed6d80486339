"""The bucketed engine of 32-bit weights: DKM's outputs, weight gradients and centroids equal DKM computed in float64
(outputs to 2e-6 and gradients to 5e-6 of the largest value), with nothing weight-sized saved for backward."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.functional import jacobian

from hf_llmkit.quantization import MarshalHooks
from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.quantization.engines import naive
from hf_llmkit.quantization.engines._grid import build_grid, locate
from hf_llmkit.quantization.engines._jets import attention_jets
from hf_llmkit.quantization.engines.bucketed import BucketedDKM
from hf_llmkit.quantization.layers import DKMLinear, DKMSettings


def test_attention_jets_are_the_derivatives():
    cents = torch.tensor([-0.03, -0.01, 0.0005, 0.02], dtype=torch.float64).unsqueeze(1)
    tau = torch.tensor(4e-4, dtype=torch.float64)
    points = torch.tensor([-0.0201, 0.0003, 0.0105, 0.00051, 0.0005], dtype=torch.float64)
    jets = attention_jets(points, cents, tau, 3).a  # 4 x [K, R]

    def a(w):
        return attention_jets(w, cents, tau, 0).a[0][:, 0]

    for i in range(points.numel()):
        w = points[i : i + 1]
        d1 = jacobian(a, w, create_graph=True)[:, 0]

        def da(v):
            return jacobian(a, v, create_graph=True)[:, 0]

        def dda(v):
            return jacobian(da, v, create_graph=True)[:, 0]

        d2 = dda(w)
        d3 = jacobian(dda, w)[:, 0]
        for n, ref in ((1, d1), (2, d2), (3, d3)):
            scale = 1 / tau.item() ** n  # the natural size of the n-th derivative
            assert (jets[n][:, i] - ref).abs().max() < 1e-9 * scale, (i, n)


def _weights(rows, cols, bits, groups, clump, seed=0):
    """Float32 weights `[rows, cols]` and k-means centroids `[G, K]`; `clump` pulls them onto their centroids (late
    in training) with every 7th exactly on one, and moves a centroid to within one temperature of another."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    vec = w.reshape(groups, -1, 1)
    cents = dkm.kmeans(vec, 1 << bits, 12, 65536)
    if clump:
        near = dkm.lookup(cents, dkm.hard_assign(vec, cents))
        vec = near + (vec - near) * 0.02
        vec.view(-1)[::7] = near.view(-1)[::7]
        cents[:, 1] = cents[:, 0] + 0.02 * 0.02 * dkm.group_std(vec)[:, None]
        w = vec.reshape(rows, cols)
    return w, cents[..., 0]


def _reference(w, cents, tau, eps, x, grad_y, iters, groups):
    """Naive DKM in float64 on the same (float32) values: output, weight gradient, final centroids."""
    w64 = w.double().requires_grad_()
    out, c = naive.soft_dkm(
        w64.reshape(groups, -1, 1), cents.double().unsqueeze(-1), tau.double(), iters, eps.double()
    )
    y = out.reshape(w.shape) if x is None else x.double() @ out.reshape(w.shape).t()
    (y * grad_y.double()).sum().backward()
    return y.detach(), w64.grad, c[..., 0].detach()


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize(
    "bits, groups, clump, iters, linear",
    [
        (3, 1, False, 3, True),  # centroids far apart: no weight-by-weight buckets
        (4, 1, False, 3, True),  # 4 bits: the central centroids are crowded (gaps ~8 tau)
        (3, 4, False, 3, True),  # a table per group of rows
        (3, 1, True, 3, True),  # weights on their centroids, two centroids within one tau
        (6, 1, False, 3, True),  # 64 centroids: crowded everywhere
        (3, 2, True, 0, False),  # no iterations; the weight itself as output (embeddings)
    ],
)
def test_bucketed_equals_float64_dkm(bits, groups, clump, iters, linear):
    w, cents = _weights(256, 192, bits, groups, clump)
    std = dkm.group_std(w.reshape(groups, -1, 1))
    tau, eps = 0.02 * std, 1e-12 * std
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 192, generator=gen) if linear else None
    grad_y = torch.randn(5 if linear else 256, 256 if linear else 192, generator=gen)
    y_ref, g_ref, c_ref = _reference(w, cents, tau, eps, x, grad_y, iters, groups)
    weight = w.clone().requires_grad_()
    y, c = BucketedDKM.apply(x, weight, cents.double(), tau.double(), eps.double(), iters, groups)
    (y * grad_y).sum().backward()
    assert _rel(y, y_ref) < 2e-6
    assert _rel(weight.grad, g_ref) < 5e-6
    assert _rel(c, c_ref) < 1e-7
    assert weight.grad.abs().sum() > 0


def test_grid_writes_each_weight_exactly_and_finely():
    w = torch.randn(2, 5000) * torch.tensor([[0.02], [3.0]])  # two groups of very different scales
    tau = (0.02 * w.std(dim=1)).double()
    grid = build_grid(w, tau)
    loc = locate(w, grid)
    u = grid.centers[loc.row.long()].float()
    assert torch.equal(u + loc.r, w)  # w = u + r exactly
    assert bool((loc.r.abs() <= grid.h.unsqueeze(1) / 2).all())
    assert bool((grid.h <= tau.float() / 32).all()) and bool((grid.h > tau.float() / 64).all())
    assert torch.equal(torch.log2(grid.h), torch.log2(grid.h).round())  # powers of two
    assert grid.moments[0].sum() == w.numel()


def test_outliers_use_a_sorted_table_and_stay_exact(monkeypatch):
    from hf_llmkit.quantization.engines import _grid

    w, cents = _weights(128, 128, 3, 1, False)
    w[0, 0] = 1e4  # stretches the grid: 640K grid points for 16K weights
    monkeypatch.setattr(_grid, "MAX_DENSE_KEYS", 0)  # (the real cap is 4M points or 4 per weight)
    std = dkm.group_std(w.reshape(1, -1, 1))
    assert build_grid(w.reshape(1, -1), (0.02 * std).double()).row_of is None
    gen = torch.Generator().manual_seed(2)
    x, grad_y = torch.randn(3, 128, generator=gen), torch.randn(3, 128, generator=gen)
    y_ref, g_ref, _ = _reference(w, cents, 0.02 * std, 1e-12 * std, x, grad_y, 3, 1)
    weight = w.clone().requires_grad_()
    y, _ = BucketedDKM.apply(x, weight, cents.double(), (0.02 * std).double(), (1e-12 * std).double(), 3, 1)
    (y * grad_y).sum().backward()
    assert _rel(y, y_ref) < 2e-6 and _rel(weight.grad, g_ref) < 5e-6


def _layer(dtype, uniquify=True, rows=1024, cols=1024):
    torch.manual_seed(0)
    layer = DKMLinear(cols, rows, False, DKMSettings.build(rows, bits=3, uniquify=uniquify), dtype=dtype)
    torch.nn.init.normal_(layer.weight, std=0.02)
    layer.init_centroids()
    return layer.train()


def test_nothing_weight_sized_is_saved_for_backward():
    layer = _layer(torch.float32)
    layer.settings = DKMSettings.build(1024, bits=3, offload=False, engine="bucketed")
    x = torch.randn(4, 1024)
    with MarshalHooks(offload=False, exclude=(x,)) as meter:
        y = layer(x)
    y.square().sum().backward()
    weight_bytes = layer.weight.numel() * 4
    assert 0 < meter.stats.stored_bytes < weight_bytes / 2  # per-bucket tables only (naive DKM: 75x the weight)
    assert layer.weight.grad.abs().sum() > 0
