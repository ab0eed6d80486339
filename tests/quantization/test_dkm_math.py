"""DKM / eDKM math: packing, k-means init, soft vs hard assignment, uniquification equal to naive DKM."""

from __future__ import annotations

import time

import pytest
import torch

from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.quantization._packing import pack_indices, packed_numel, unpack_indices
from hf_llmkit.quantization.engines import table as edkm
from hf_llmkit.quantization.layers import DKMEmbedding, DKMLinear, DKMSettings


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [1, 7, 8, 1001])
def test_pack_round_trip(bits, count):
    idx = torch.randint(0, 1 << bits, (count,), generator=torch.Generator().manual_seed(bits))
    packed = pack_indices(idx, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_numel(count, bits) == (count * bits + 7) // 8
    assert torch.equal(unpack_indices(packed, bits, count), idx)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 8\)"):
        pack_indices(torch.tensor([8]), 3)
    with pytest.raises(ValueError, match="flat uint8 tensor of 3 bytes"):
        unpack_indices(torch.zeros(4, dtype=torch.uint8), 3, 8)


def test_kmeans_beats_uniform_grid_and_is_fast():
    torch.manual_seed(0)
    w = torch.randn(1, 1 << 20, 1) * 0.02
    start = time.perf_counter()
    cents = dkm.kmeans(w, 8, iters=12, sample=65536)
    elapsed = time.perf_counter() - start
    err = (dkm.lookup(cents, dkm.hard_assign(w, cents)) - w).square().mean()
    grid = torch.linspace(w.min(), w.max(), 8).view(1, 8, 1)
    err_grid = (dkm.lookup(grid, dkm.hard_assign(w, grid)) - w).square().mean()
    assert err < 0.5 * err_grid
    assert elapsed < 30  # a generous bound: it is a fraction of a second, never minutes


def test_hard_assignment_of_scalars_is_the_exactly_nearest_entry_of_an_unsorted_table():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(3, 16, 1, generator=gen)
    table[1, 5] = table[1, 9]  # equal entries: the first
    values = torch.randn(3, 5000, 1, generator=gen) * 1.5
    values[0, :4, 0] = (table[0, 2, 0] + table[0, 7, 0]) / 2  # a tie at some midpoint (possibly not neighbours)
    distance = (values - table.transpose(1, 2)).abs()  # [G, n, K]: exact in float32 for these magnitudes
    nearest = distance.argmin(-1)
    got = dkm.hard_assign(values, table)
    assert torch.equal(distance.gather(2, got.unsqueeze(-1)), distance.gather(2, nearest.unsqueeze(-1)))
    assert (got[1] == 5).any() and not (got[1] == 9).any()  # of two equal entries, the first is taken
    ranked = table[..., 0].sort(dim=1).values
    mid = (ranked[:, 1:] + ranked[:, :-1]) / 2
    at_mid = mid[0, 3].expand(1, 1, 1)  # exactly between the 4th and 5th smallest entries: the smaller
    assert table[0, dkm.hard_assign(at_mid, table[:1])[0, 0], 0] == ranked[0, 3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_16_bit_tables_are_assigned_by_bit_pattern_with_the_same_answer_as_the_search(dtype):
    """Tables of at least 4 x 65,536 16-bit weights take the pattern lookup; it answers what the search does for
    every weight: NaN, infinities, both zeros, values at a midpoint, equal entries, each group its own table."""
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(3, 8, 1, generator=gen) * 0.02
    table[2, 1] = table[2, 6]  # equal entries
    values = (torch.randn(3, 4 * dkm.PATTERNS, generator=gen) * 0.03).to(dtype)
    values[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    ranked = table[..., 0].sort(dim=1).values
    values[1, 5:8] = ((ranked[1, 2] + ranked[1, 3]) / 2).to(dtype)  # near (or at) a midpoint
    assert dkm._by_pattern(values.unsqueeze(-1)) and not dkm._by_pattern(values[:, :-1].unsqueeze(-1))
    assert not dkm._by_pattern(values.float().unsqueeze(-1))
    by_pattern = dkm.hard_assign(values.unsqueeze(-1), table)
    assert torch.equal(by_pattern, dkm._nearest_scalar(values, table[..., 0]))
    assert torch.equal(by_pattern[:, :-1], dkm.hard_assign(values[:, :-1].unsqueeze(-1), table))  # the search


def _layer(dtype, uniquify, d=1, groups=1, seed=0, rows=64, cols=96, shard=False, offload=False):
    torch.manual_seed(seed)
    settings = DKMSettings.build(
        rows, groups=groups, bits=3, cluster_dim=d, uniquify=uniquify, shard=shard, offload=offload, epsilon=1e-9
    )
    layer = DKMLinear(cols, rows, True, settings, dtype=dtype)
    torch.nn.init.normal_(layer.weight, std=0.02)
    layer.init_centroids()
    return layer.train()


def _fwd_bwd(layer, seed=1):
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(seed)).to(layer.weight.dtype)
    y = layer(x)
    (y.float().square().sum() + y.float().sum()).backward()
    return y.detach().float(), layer.weight.grad.float().clone(), layer.centroids.clone()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize(
    "dtype, d, groups, mode",
    [
        (torch.bfloat16, 1, 1, "direct"),  # inverse index = the weight's bit pattern
        (torch.float16, 1, 1, "direct"),
        (torch.float32, 1, 1, "identity"),  # 32-bit weights are nearly all distinct: no table
        (torch.bfloat16, 1, 4, "inverse"),  # more tables than 65,536 patterns pay off: sorted unique keys
        (torch.bfloat16, 2, 2, "inverse"),
        (torch.float16, 4, 1, "inverse"),
    ],
)
def test_uniquified_equals_naive(dtype, d, groups, mode):
    rows, cols = (256, 256) if mode == "direct" else (64, 96)
    naive = _layer(dtype, False, d, groups, rows=rows, cols=cols)
    fast = _layer(dtype, True, d, groups, rows=rows, cols=cols)
    assert edkm.build_table(fast.weight, groups, d).mode == mode
    y0, g0, c0 = _fwd_bwd(naive)
    y1, g1, c1 = _fwd_bwd(fast)
    tol = 1e-3 if dtype == torch.float32 else 2e-2  # 16-bit outputs and gradients round to 8-11 bits
    assert _rel(y1, y0) < tol
    assert _rel(g1, g0) < tol
    assert _rel(c1, c0) < 1e-4
    assert g0.abs().sum() > 0


def test_uniquified_table_is_small_for_16_bit_weights():
    w = (torch.randn(1024, 1024) * 0.02).bfloat16()
    table = edkm.build_table(w, 1, 1)
    assert table.mode == "direct" and int(table.counts.sum()) == w.numel()
    assert table.values.shape[0] == w.unique().numel() < 65536  # bf16 at std 0.02: a few thousand values
    assert torch.equal(table.values[edkm.table_index(w, table)].squeeze(-1), w.float().reshape(-1))


def test_soft_in_training_hard_in_eval():
    layer = _layer(torch.float32, True)
    x = torch.randn(3, layer.in_features)
    layer.eval()
    w_hard = layer.hard_weight(torch.float32)
    per_group = w_hard.reshape(1, -1).unique()
    assert per_group.numel() <= 8
    assert torch.allclose(layer(x), torch.nn.functional.linear(x, w_hard, layer.bias))
    layer.train()
    y_soft = layer(x)
    assert not torch.allclose(y_soft, torch.nn.functional.linear(x, w_hard, layer.bias), atol=1e-6)
    with torch.no_grad():  # no graph -> no soft assignment
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.hard_weight(x.dtype), layer.bias))


def test_training_moves_weights_toward_centroids():
    """A few steps of DKM training lower the clustering error of the latent weight (the point of DKM)."""
    layer = _layer(torch.float32, True, rows=32, cols=64)
    target = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    x = torch.randn(64, 64)

    def clustering_error():
        return (layer.hard_weight(torch.float32) - layer.weight).square().mean().item()

    before = clustering_error()
    for _ in range(20):
        opt.zero_grad()
        loss = (layer(x) - target(x).detach()).square().mean()
        loss.backward()
        opt.step()
    assert clustering_error() < before


def test_embedding_soft_and_hard():
    settings = DKMSettings.build(100, kind="embedding", embedding_bits=4, cluster_dim=2, offload=False)
    emb = DKMEmbedding(100, 16, None, settings)
    emb.init_centroids()
    ids = torch.tensor([[1, 5, 99]])
    out = emb.train()(ids)
    out.sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad.abs().sum() > 0
    emb.eval()
    assert emb(ids).reshape(-1, 2).unique(dim=0).shape[0] <= 16


@pytest.mark.parametrize("scales", [False, True])
def test_hard_decode_of_a_large_16_bit_table_is_the_decoded_search(scales):
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(256, 1024, generator=gen) * 0.02).to(torch.bfloat16)  # 4 x 65,536 weights, one table
    table = torch.randn(1, 8, 1, generator=gen) * 0.02
    s = dkm.block_scales(weight, 64, torch.float16) if scales else None
    vectors = (weight.float() / dkm.expand_scales(s, 1024) if scales else weight).reshape(1, -1, 1)
    expected = dkm.decode(table, dkm._nearest_scalar(vectors[..., 0], table[..., 0]), weight.shape, s)
    assert torch.equal(dkm.hard_decode(vectors, table, weight.shape, s), expected)
