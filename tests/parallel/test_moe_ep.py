"""Expert parallelism on real gloo groups: 2 and 4 ranks give EP=1's outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_llmkit.parallel import MoELayer, new_expert_parallel_group
from hf_llmkit.testing import launch

H, INTER, E = 16, 24, 8


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def ep_matches_dense(group: dist.ProcessGroup, capacity_factor: float | None) -> dict[str, float]:
    """One rank: compare a layer sharded over `group` with an EP=1 layer built from the same seed."""
    rank, ep_rank, ep_size = dist.get_rank(), dist.get_rank(group), dist.get_world_size(group)
    kwargs = dict(num_experts=E, top_k=2, capacity_factor=capacity_factor)
    torch.manual_seed(0)
    full = MoELayer(H, INTER, **kwargs)
    torch.manual_seed(0)
    sharded = MoELayer(H, INTER, ep_group=group, **kwargs)
    local = slice(ep_rank * E // ep_size, (ep_rank + 1) * E // ep_size)

    # Each rank routes its own tokens, a different number per rank (uneven all-to-all splits).
    torch.manual_seed(100 + rank)
    tokens = torch.randn(2, 5 + 3 * rank, H)
    grad_out = torch.randn(2, 5 + 3 * rank, H)
    x_full, x_ep = tokens.clone().requires_grad_(), tokens.clone().requires_grad_()
    y_full, y_ep = full(x_full), sharded(x_ep)
    (y_full * grad_out).sum().backward()
    (y_ep * grad_out).sum().backward()
    # An expert's gradient collects the tokens of its whole EP group: sum the group's EP=1 per-rank gradients.
    for p in (full.experts.gate_up_proj, full.experts.down_proj):
        dist.all_reduce(p.grad, group=group)
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


def ep_worker() -> dict:
    """All checks in one 4-rank launch (starting ranks dominates the cost): EP=4, and EP=2 as two groups of 2."""
    results = {}
    ep4, ep2 = new_expert_parallel_group(ep_size=4), new_expert_parallel_group(ep_size=2)
    results[(4, None)] = ep_matches_dense(ep4, None)
    results[(2, None)] = ep_matches_dense(ep2, None)
    results[(2, 0.75)] = ep_matches_dense(ep2, 0.75)
    for size, group in ((4, ep4), (2, ep2)):
        try:
            MoELayer(H, INTER, num_experts=size + 1, top_k=2, ep_group=group)
            results[("indivisible", size)] = "no error"
        except ValueError as err:
            results[("indivisible", size)] = str(err)
    return results


@pytest.fixture(scope="module")
def ep_results() -> list[dict]:
    return launch(ep_worker, nprocs=4, timeout=240)


@pytest.mark.parametrize(("ep_size", "capacity_factor"), [(4, None), (2, None), (2, 0.75)], ids=str)
def test_expert_parallel_equals_single_rank(ep_results, ep_size, capacity_factor):
    for rank, per_rank in enumerate(ep_results):
        res = per_rank[(ep_size, capacity_factor)]
        assert res["weights"] == 0.0, f"rank {rank} does not hold the EP=1 slice of experts"
        assert res["output_norm"] > 0
        for key in ("output", "grad_input", "grad_router", "grad_gate_up", "grad_down"):
            assert res[key] < 1e-5, f"rank {rank}: {key} differs from EP=1 by {res[key]}"
    if capacity_factor is not None:
        assert any(r[(ep_size, capacity_factor)]["dropped"] > 0 for r in ep_results), "capacity 0.75 should drop"


@pytest.mark.parametrize("ep_size", [2, 4])
def test_experts_not_divisible_by_ep_size_is_rejected(ep_results, ep_size):
    for per_rank in ep_results:
        assert f"not divisible by the expert-parallel group size {ep_size}" in per_rank[("indivisible", ep_size)]
