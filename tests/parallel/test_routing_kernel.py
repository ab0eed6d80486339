"""The MoE routing copies' C kernel (`_routing_native.c`, used by `hf_llmkit.parallel.moe.dispatch`) on this CPU.

`rows_to_tokens` (forward and backward) and `tokens_to_rows`' backward give torch's ops' results (the path GPUs and
bfloat16 take) within float32 rounding, dropless and with slots dropped by a capacity limit, at top-1/2/3 and at 1
and 2 threads (bit for bit between thread counts); inputs that are not float32 on the CPU take torch's ops; and a
`MoELayer` trains to the same gradients with and without it.
"""

from __future__ import annotations

import pytest
import torch

from hf_llmkit.parallel import MoELayer
from hf_llmkit.parallel.moe import dispatch


@pytest.fixture(autouse=True)
def kernel_built():
    if dispatch._KERNEL.library() is None:
        pytest.fail(f"the routing kernel did not build here: {dispatch._KERNEL.unavailable_reason()}")


def route(tokens: int, k: int, experts: int, keep: float, seed: int):
    """`order` / `pos` as `MoELayer.forward` builds them, keeping the first `keep` of each expert's slots."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    if keep < 1:
        load = torch.bincount(flat, minlength=experts)
        rank = torch.arange(flat.numel()) - (load.cumsum(0) - load)[flat[order]]
        order = order[rank < max(int(keep * tokens * k / experts), 1)]
    return order, dispatch.slot_positions(order, flat.numel())


def run_both_ways(x, rows_in, weights, order, pos, k, d_out, threads: int, kernel: bool, monkeypatch):
    with monkeypatch.context() as patch:
        if not kernel:
            patch.setattr(dispatch, "kernel_serves", lambda *tensors: False)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            x, rows_in, weights = (t.detach().requires_grad_(True) for t in (x, rows_in, weights))
            rows = dispatch.tokens_to_rows(x, order, pos, k)
            out = dispatch.rows_to_tokens(rows_in, weights, order, pos)
            (rows * rows_in.detach()).sum().backward()  # tokens_to_rows' backward sees a gradient per row
            out.backward(d_out)
        finally:
            torch.set_num_threads(before)
    return out.detach(), x.grad, rows_in.grad, weights.grad


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("k", "keep"), [(1, 1.0), (2, 1.0), (3, 1.0), (2, 0.6)], ids=str)
def test_combine_and_gather_backward_are_torchs_ops_within_float32_rounding(k, keep, threads, monkeypatch):
    tokens, hidden, experts = 37, 45, 5
    order, pos = route(tokens, k, experts, keep, seed=k)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g)
    rows_in = torch.randn(order.numel(), hidden, generator=g)
    weights = torch.rand(tokens, k, generator=g)
    d_out = torch.randn(tokens, hidden, generator=g)
    args = (x, rows_in, weights, order, pos, k, d_out)
    got = run_both_ways(*args, threads, True, monkeypatch)
    want = run_both_ways(*args, threads, False, monkeypatch)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if keep < 1:
        assert order.numel() < tokens * k and (got[3] == 0).sum() == tokens * k - order.numel()  # dropped: dw 0
    other = run_both_ways(*args, 3 - threads, True, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(got, other))  # each token's sums are the same at any thread count


def test_only_float32_cpu_tensors_with_int64_positions_take_the_kernel():
    pos, rows = torch.zeros(4, dtype=torch.int64), torch.zeros(2, 3)
    assert dispatch.kernel_serves(pos, rows, rows)
    assert not dispatch.kernel_serves(pos, rows, rows.bfloat16())
    assert not dispatch.kernel_serves(pos.int(), rows)
    assert not dispatch.kernel_serves(pos, rows.double())


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_a_layer_with_the_kernel_equals_the_layer_on_torch_ops(capacity_factor, monkeypatch):
    torch.manual_seed(0)
    layer = MoELayer(32, 48, num_experts=4, top_k=2, capacity_factor=capacity_factor)
    x = torch.randn(2, 50, 32)
    grads = []
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setattr(dispatch, "kernel_serves", lambda *tensors: False)
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        (out.square().sum() + layer.aux.load_balancing_loss).backward()
        grads.append([out.detach(), xi.grad, *(p.grad.clone() for p in layer.parameters())])
        layer.zero_grad(set_to_none=True)
    for got, want in zip(*grads):  # the router's gradient sums dw over tokens: float32 rounding, scaled
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
