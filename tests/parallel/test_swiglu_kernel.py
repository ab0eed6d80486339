"""The experts' C SwiGLU kernel (`hf_llmkit.parallel.moe.swiglu_kernel`) on this machine's CPU.

In each of its loops (AVX2 where the CPU has it, portable) and at 1 and 2 threads, forward and backward are within
float32 rounding of torch's ops (`silu`, `mul`, `silu_backward`) on the same tile; NaN stays NaN and large
pre-activations saturate as torch's do; a `MoELayer` gives the same outputs and gradients with and without it; and
without a C compiler the layer answers through torch's ops with one warning per kernel (this one's and the routing
kernel's).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from hf_llmkit.parallel import MoELayer
from hf_llmkit.parallel.moe import swiglu_kernel as kernel


@pytest.fixture(params=kernel.LOOPS)
def loops(request):
    if kernel.library() is None:
        pytest.fail(f"the C kernel did not build here: {kernel._KERNEL.unavailable_reason()}")
    if kernel.LOOPS.index(request.param) > kernel.LOOPS.index(kernel.loops()):
        pytest.skip(f"this CPU cannot run the {request.param} loops")
    kernel.cap_loops(request.param)
    yield request.param
    kernel.cap_loops(kernel.LOOPS[-1])


def torch_ops(h: torch.Tensor, da: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gate, up = h.chunk(2, dim=1)
    act = F.silu(gate)
    dh = torch.cat([torch.ops.aten.silu_backward(da * up, gate), da * act], dim=1)
    return act, act * up, dh


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "inter"), [(1, 1), (7, 5), (33, 45), (300, 256)], ids=str)
def test_forward_and_backward_are_torchs_ops_within_float32_rounding(loops, rows, inter, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(rows * 1000 + inter)
        h = torch.randn(rows, 2 * inter, generator=g) * 4  # pre-activations well into both tails of silu
        da = torch.randn(rows, inter, generator=g)
        hidden = kernel.forward(h)
        dh, again = kernel.backward(h, da)
    finally:
        torch.set_num_threads(before)
    _, want_hidden, want_dh = torch_ops(h, da)
    for got, want in ((hidden, want_hidden), (again, want_hidden), (dh, want_dh)):
        torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6)
    assert torch.equal(hidden, again)  # backward's recomputation is forward's, bit for bit


def test_nan_stays_nan_and_large_pre_activations_saturate_like_torch(loops):
    gate = torch.tensor([[float("nan"), 0.0, -100.0, 100.0, -87.5, 88.5, 1e-30, -3.0]])
    h = torch.cat([gate, torch.full_like(gate, 2.0)], dim=1)
    da = torch.ones_like(gate)
    hidden = kernel.forward(h)
    dh, _ = kernel.backward(h, da)
    _, ref_hidden, ref_dh = torch_ops(h, da)
    for got, want in ((hidden, ref_hidden), (dh, ref_dh)):
        assert torch.isnan(got[0, 0]) and torch.isnan(want[0, 0])
        torch.testing.assert_close(got[:, 1:8], want[:, 1:8], rtol=4e-6, atol=1e-30)
    assert torch.isnan(dh[0, 8])  # d up of the NaN column


def test_bad_gradient_is_refused_in_one_line():
    if kernel.library() is None:
        pytest.fail(f"the C kernel did not build here: {kernel._KERNEL.unavailable_reason()}")
    with pytest.raises(ValueError, match=r"^da must be float32 \[3, 4\], got torch.float64 \[3, 4\]$"):
        kernel.backward(torch.randn(3, 8), torch.randn(3, 4, dtype=torch.float64))


def test_a_layer_with_the_kernel_equals_the_layer_on_torch_ops(monkeypatch):
    torch.manual_seed(0)
    layer = MoELayer(32, 48, num_experts=4, top_k=2)
    x = torch.randn(2, 50, 32)
    grads = []
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setattr(kernel, "serves", lambda h: False)
        else:
            assert kernel.serves(torch.empty(1, 2))
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.square().sum().backward()
        grads.append([out.detach(), xi.grad, *(p.grad.clone() for p in layer.parameters())])
        layer.zero_grad(set_to_none=True)
    for got, want in zip(*grads):  # the router's gradient sums over tokens: float32 rounding, scaled
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_with_the_kernel_backward_keeps_neither_the_activation_nor_the_hidden_rows(monkeypatch):
    torch.manual_seed(0)
    inter, tokens = 48, 60
    layer = MoELayer(32, inter, num_experts=4, top_k=2)
    x = torch.randn(tokens, 32)

    def saved_bytes() -> int:
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x)
        return sum(seen.values())

    assert kernel.serves(torch.empty(1, 2))
    with_kernel = saved_bytes()
    monkeypatch.setattr(kernel, "serves", lambda h: False)
    # torch's ops keep silu(gate) and silu(gate) * up for each routed row: 2 * [tokens * top_k, inter] float32
    assert saved_bytes() - with_kernel == 2 * tokens * 2 * inter * 4


def test_without_a_c_compiler_the_layer_runs_on_torch_ops_and_says_so_once(without_a_c_compiler, caplog):
    torch.manual_seed(0)
    layer = MoELayer(16, 24, num_experts=4, top_k=2)
    x = torch.randn(40, 16, requires_grad=True)
    with caplog.at_level(logging.INFO):
        layer(x).sum().backward()
        layer(x).sum().backward()
    assert torch.isfinite(x.grad).all()
    lines = [r.getMessage() for r in caplog.records]
    for kernel_name in ("The MoE experts' CPU kernel", "The MoE routing CPU kernel"):
        assert sum(line.startswith(f"{kernel_name} is not available (") for line in lines) == 1, lines
