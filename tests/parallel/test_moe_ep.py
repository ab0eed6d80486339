"""Expert parallelism on real gloo groups: 2 and 4 ranks give EP=1's outputs and gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_llmkit.parallel import MoELayer, new_expert_parallel_group
from hf_llmkit.testing import launch

H, INTER, E = 16, 24, 8


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def ep_matches_dense(capacity_factor: float | None) -> dict[str, float]:
    """One rank: compare an EP=world layer with an EP=1 layer built from the same seed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs = dict(num_experts=E, top_k=2, capacity_factor=capacity_factor)
    torch.manual_seed(0)
    full = MoELayer(H, INTER, **kwargs)
    torch.manual_seed(0)
    sharded = MoELayer(H, INTER, ep_group=new_expert_parallel_group(ep_size=world), **kwargs)
    local = slice(rank * E // world, (rank + 1) * E // world)

    # Each rank routes its own tokens, a different number per rank (uneven all-to-all splits).
    torch.manual_seed(100 + rank)
    tokens = torch.randn(2, 5 + 3 * rank, H)
    grad_out = torch.randn(2, 5 + 3 * rank, H)
    x_full, x_ep = tokens.clone().requires_grad_(), tokens.clone().requires_grad_()
    y_full, y_ep = full(x_full), sharded(x_ep)
    (y_full * grad_out).sum().backward()
    (y_ep * grad_out).sum().backward()
    # An expert's gradient collects every rank's tokens: sum the EP=1 per-rank gradients.
    for p in (full.experts.gate_up_proj, full.experts.down_proj):
        dist.all_reduce(p.grad)
    return {
        "weights": _max_diff(full.experts.down_proj[local], sharded.experts.down_proj),
        "output": _max_diff(y_full, y_ep),
        "grad_input": _max_diff(x_full.grad, x_ep.grad),
        "grad_router": _max_diff(full.gate.weight.grad, sharded.gate.weight.grad),
        "grad_gate_up": _max_diff(full.experts.gate_up_proj.grad[local], sharded.experts.gate_up_proj.grad),
        "grad_down": _max_diff(full.experts.down_proj.grad[local], sharded.experts.down_proj.grad),
        "dropped": float(sharded.aux.dropped_fraction),
        "output_norm": y_ep.abs().max().item(),
    }


def ep_worker(capacity_factors: list[float | None]) -> dict:
    """All checks of one launch (spawning ranks dominates the cost, so one launch runs several cases)."""
    results = {cf: ep_matches_dense(cf) for cf in capacity_factors}
    try:
        world = dist.get_world_size()
        MoELayer(H, INTER, num_experts=world + 1, top_k=2, ep_group=new_expert_parallel_group(ep_size=world))
        results["indivisible"] = "no error"
    except ValueError as err:
        results["indivisible"] = str(err)
    return results


def _check(results: list[dict], capacity_factor: float | None) -> None:
    for rank, per_rank in enumerate(results):
        res = per_rank[capacity_factor]
        assert res["weights"] == 0.0, f"rank {rank} does not hold the EP=1 slice of experts"
        assert res["output_norm"] > 0
        for key in ("output", "grad_input", "grad_router", "grad_gate_up", "grad_down"):
            assert res[key] < 1e-5, f"rank {rank}: {key} differs from EP=1 by {res[key]} (capacity {capacity_factor})"
    if capacity_factor is not None:
        assert any(r[capacity_factor]["dropped"] > 0 for r in results), "capacity 0.75 should drop routed tokens"


def test_expert_parallel_two_ranks_equal_single_rank():
    results = launch(ep_worker, [None, 0.75], nprocs=2, timeout=180)
    _check(results, None)
    _check(results, 0.75)
    assert all("not divisible by the expert-parallel group size 2" in r["indivisible"] for r in results)


def test_expert_parallel_four_ranks_equal_single_rank():
    results = launch(ep_worker, [None], nprocs=4, timeout=180)
    _check(results, None)
    assert all("not divisible by the expert-parallel group size 4" in r["indivisible"] for r in results)
