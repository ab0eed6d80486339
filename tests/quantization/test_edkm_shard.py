"""eDKM sharding on 2 real gloo ranks: the table split across ranks gives the unsharded result."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_llmkit.quantization.layers import DKMLinear, DKMSettings
from hf_llmkit.testing import launch


def _step(uniquify: bool, shard: bool, dtype: torch.dtype, groups: int, amp: bool = False) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)  # the same layer on every rank
    settings = DKMSettings(bits=3, cluster_dim=1, groups=groups, uniquify=uniquify, shard=shard, epsilon=1e-9)
    layer = DKMLinear(128, 64, False, settings, dtype=dtype)
    torch.nn.init.normal_(layer.weight, std=0.02)
    layer.init_centroids()
    layer.train()
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(100 + dist.get_rank())).to(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        y = layer(x)  # each rank its own data, as in data parallel
    assert y.dtype == (torch.bfloat16 if amp else dtype)
    (y.float().square().sum()).backward()
    grad = layer.weight.grad.float()
    dist.all_reduce(grad)  # what DDP does with the gradients
    return y.detach().float(), grad / dist.get_world_size(), layer.centroids.clone()


CASES = [(True, "float32", 1), (True, "bfloat16", 2), (False, "float32", 1)]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def shard_matches_unsharded() -> list[dict[str, float]]:
    """Every case on this rank: relative differences sharded vs unsharded (one launch: rank start-up is slow)."""
    from hf_llmkit.quantization.layers import shard_group

    out = []
    for uniquify, dtype_name, groups in CASES:
        dtype = getattr(torch, dtype_name)
        ref = _step(uniquify, False, dtype, groups)
        got = _step(uniquify, True, dtype, groups)

        out.append({"y": rel(got[0], ref[0]), "grad": rel(got[1], ref[1]), "centroids": rel(got[2], ref[2])})
    ref = _step(True, False, torch.float32, 2)
    got = _step(True, True, torch.float32, 2, amp=True)  # under bf16 autocast: the product in bf16, DKM in fp32
    out.append({"y": rel(got[0], ref[0]), "grad": rel(got[1], ref[1]), "centroids": rel(got[2], ref[2])})
    out.append({"sharded_world": dist.get_world_size(shard_group())})
    return out


def test_sharded_table_equals_unsharded_on_two_ranks():
    results = launch(shard_matches_unsharded, nprocs=2, timeout=240)
    for rank, per_case in enumerate(results):
        assert per_case[-1]["sharded_world"] == 2
        for (_, dtype_name, _), diffs in zip(CASES + [(True, "autocast", 2)], per_case):
            tol = {"float32": 1e-4, "bfloat16": 1e-2, "autocast": 2e-2}[dtype_name]
            assert diffs["y"] < tol, (rank, dtype_name, diffs)
            assert diffs["grad"] < tol, (rank, dtype_name, diffs)
            assert diffs["centroids"] < 1e-5, (rank, dtype_name, diffs)
