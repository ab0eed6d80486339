"""MoELayer: routing, grouped experts, capacity, auxiliary losses, transformers compatibility, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, Qwen2MoeConfig
from transformers.activations import ACT2FN
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

import hf_llmkit.parallel.moe.experts as experts_module
from hf_llmkit.parallel import MoELayer
from hf_llmkit.parallel.moe.dispatch import rows_to_tokens, slot_positions, tokens_to_rows
from hf_llmkit.parallel.moe.experts import GroupedSwiGLU
from hf_llmkit.parallel.moe.grad_buffers import GradientBuffer

H, INTER, E = 16, 24, 4


def per_token_reference(layer: MoELayer, x: torch.Tensor, *, act: str = "silu") -> torch.Tensor:
    """The MoE definition, one token and one chosen expert at a time."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = F.linear(tokens, layer.gate.weight).softmax(-1)
    weights, experts = probs.topk(layer.top_k, dim=-1)
    if layer.gate.normalize_top_k:
        weights = weights / weights.sum(-1, keepdim=True)
    rows = []
    for t in range(tokens.shape[0]):
        acc = torch.zeros_like(tokens[t])
        for j in range(layer.top_k):
            e = experts[t, j]
            gate, up = (layer.experts.gate_up_proj[e] @ tokens[t]).chunk(2)
            acc = acc + weights[t, j] * (layer.experts.down_proj[e] @ (ACT2FN[act](gate) * up))
        rows.append(acc)
    return torch.stack(rows).reshape(x.shape)


@pytest.mark.parametrize(
    ("top_k", "normalize", "act"), [(1, False, "silu"), (2, True, "silu"), (3, False, "gelu")], ids=str
)
def test_output_and_gradients_match_per_token_definition(top_k, normalize, act):
    torch.manual_seed(0)
    layer = MoELayer(H, INTER, num_experts=E, top_k=top_k, normalize_top_k=normalize, hidden_act=act)
    x = torch.randn(3, 7, H, requires_grad=True)
    grad_out = torch.randn(3, 7, H)
    params = [x, layer.gate.weight, layer.experts.gate_up_proj, layer.experts.down_proj]
    ours = layer(x)
    ref = per_token_reference(layer, x, act=act)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(torch.autograd.grad(ours, params, grad_out), torch.autograd.grad(ref, params, grad_out)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize(
    ("counts", "row_tile", "sizes"),
    [
        ((2, 0, 4, 1), 512, [2, 4, 1]),
        ((5, 0, 3, 1), 2, [1, 2, 2, 1, 2, 1]),
        ((7, 0, 3), 3, [2, 2, 3, 3]),
    ],
    ids=["one-tile-each", "several-tiles-per-expert", "equal-tiles"],
)
def test_grouped_experts_gradcheck(act, counts, row_tile, sizes, monkeypatch):
    # Small tiles split an expert's rows into equal tiles (its weight gradient accumulates over them).
    monkeypatch.setattr(experts_module, "ROW_TILE", row_tile)
    assert [t.hi - t.lo for t in experts_module._tiles(counts)] == sizes
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 4, dtype=torch.double, requires_grad=True)
    gate_up = torch.randn(len(counts), 6, 4, dtype=torch.double, requires_grad=True)
    down = torch.randn(len(counts), 4, 3, dtype=torch.double, requires_grad=True)
    buffers = (GradientBuffer(), GradientBuffer())  # gradcheck's many backwards reuse or refuse their memory
    fn = lambda a, b, c: GroupedSwiGLU.apply(a, b, c, counts, act, buffers)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, gate_up, down))
    fn(x, gate_up, down).sum().backward()
    for e, n in enumerate(counts):
        if n == 0:
            assert gate_up.grad[e].abs().sum() == 0 and down.grad[e].abs().sum() == 0


@pytest.mark.parametrize("kept", [None, [0, 3, 4, 6, 9]], ids=["dropless", "dropping"])
def test_row_routing_gradcheck(kept):
    """tokens -> expert-sorted rows -> weighted tokens, with and without dropped (token, slot) pairs."""
    torch.manual_seed(0)
    tokens, k = 5, 2
    x = torch.randn(tokens, 3, dtype=torch.double, requires_grad=True)
    weights = torch.rand(tokens, k, dtype=torch.double, requires_grad=True)
    order = torch.randperm(tokens * k)
    if kept is not None:
        order = order[torch.tensor(kept)]
    pos = slot_positions(order, tokens * k)
    fn = lambda a, w: rows_to_tokens(tokens_to_rows(a, order, pos, k) * 2.0, w, order, pos)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, weights))
    kept_slots = torch.zeros(tokens * k, dtype=torch.double).index_fill_(0, order, 1.0).view(tokens, k)
    expected = 2.0 * (weights * kept_slots).sum(1, keepdim=True) * x  # every kept slot returns its own token
    torch.testing.assert_close(fn(x, weights), expected)


def test_capacity_factor_drops_overflow_in_token_order_and_reports_it():
    torch.manual_seed(0)
    layer = MoELayer(H, INTER, num_experts=E, top_k=2, capacity_factor=0.5)
    x = torch.randn(40, H)
    out = layer(x)
    capacity = math.ceil(0.5 * 40 * 2 / E)
    load = layer.aux.expert_load
    assert load.sum() == 80
    expected_kept = load.clamp(max=capacity).sum().item()
    assert layer.aux.dropped_fraction.item() == pytest.approx(1 - expected_kept / 80)
    assert layer.aux.dropped_fraction > 0
    # Same result by hand: zero the routing weight of every (token, slot) past its expert's capacity.
    _, experts = F.linear(x, layer.gate.weight).softmax(-1).topk(2, dim=-1)
    seen = torch.zeros(E, dtype=torch.long)
    keep = torch.zeros(40, 2, dtype=torch.bool)
    for t in range(40):
        for j in range(2):
            e = experts[t, j]
            keep[t, j] = seen[e] < capacity
            seen[e] += 1
    dropless = MoELayer(H, INTER, num_experts=E, top_k=2)
    dropless.load_state_dict(layer.state_dict())
    full = per_token_reference(dropless, x)
    assert not torch.allclose(out, full, atol=1e-4)
    kept_tokens = keep.all(dim=1)
    torch.testing.assert_close(out[kept_tokens], full[kept_tokens], atol=1e-5, rtol=1e-5)
    # A capacity that cannot bind gives the dropless result.
    roomy = MoELayer(H, INTER, num_experts=E, top_k=2, capacity_factor=float(E))
    roomy.load_state_dict(layer.state_dict())
    torch.testing.assert_close(roomy(x), full, atol=1e-5, rtol=1e-5)
    assert roomy.aux.dropped_fraction == 0


def test_aux_losses_values_and_gradients():
    layer = MoELayer(H, INTER, num_experts=E, top_k=2)
    with torch.no_grad():
        layer.gate.weight.zero_()  # uniform router: balancing loss is exactly top_k, z-loss log(E)^2
    layer(torch.randn(10, H))
    assert layer.aux.load_balancing_loss.item() == pytest.approx(2.0)
    assert layer.aux.z_loss.item() == pytest.approx(math.log(E) ** 2)
    torch.manual_seed(1)
    skewed = MoELayer(H, INTER, num_experts=E, top_k=2)
    with torch.no_grad():
        skewed.gate.weight[0] = 0.5  # positive tokens all prefer expert 0
    skewed(torch.randn(64, H) + 1.0)
    assert skewed.aux.expert_load[0] == 64
    assert skewed.aux.load_balancing_loss > 2.5
    (skewed.aux.load_balancing_loss + skewed.aux.z_loss).backward()
    assert skewed.gate.weight.grad.abs().sum() > 0
    assert int(skewed.aux.expert_load.sum()) == 128


def test_jitter_noise_only_in_training_and_only_on_the_router():
    torch.manual_seed(0)
    layer = MoELayer(H, INTER, num_experts=E, top_k=2, jitter_noise=0.3).eval()
    x = torch.randn(20, H)
    torch.testing.assert_close(layer(x), per_token_reference(layer, x), atol=1e-5, rtol=1e-5)
    layer.train()
    torch.manual_seed(1)
    noisy = layer(x)
    # With identical experts and renormalised weights the output ignores routing: noise must not reach experts.
    with torch.no_grad():
        layer.experts.gate_up_proj.copy_(layer.experts.gate_up_proj[:1].expand(E, -1, -1))
        layer.experts.down_proj.copy_(layer.experts.down_proj[:1].expand(E, -1, -1))
    same = layer(x)
    layer.eval()
    torch.testing.assert_close(same, layer(x), atol=1e-5, rtol=1e-5)
    assert noisy.shape == x.shape


def _tiny(cls_config, **kw):
    return cls_config(hidden_size=H, intermediate_size=INTER, num_attention_heads=2, num_key_value_heads=2, **kw)


def test_state_dict_and_outputs_equal_transformers_mixtral_block():
    torch.manual_seed(0)
    native = MixtralSparseMoeBlock(_tiny(MixtralConfig, num_local_experts=E, num_experts_per_tok=2))
    for p in native.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = MoELayer(H, INTER, num_experts=E, top_k=2)
    ours.load_state_dict(native.state_dict())  # strict: same keys and shapes
    x = torch.randn(2, 9, H)
    torch.testing.assert_close(ours(x), native(x), atol=1e-5, rtol=1e-5)


def test_shared_expert_equals_transformers_qwen2_moe_block():
    torch.manual_seed(0)
    config = _tiny(
        Qwen2MoeConfig, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=INTER,
        shared_expert_intermediate_size=20, norm_topk_prob=False,
    )  # fmt: skip
    native = Qwen2MoeSparseMoeBlock(config)
    for p in native.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = MoELayer(H, INTER, num_experts=E, top_k=2, normalize_top_k=False, shared_expert_intermediate_size=20)
    ours.load_state_dict(native.state_dict())
    x = torch.randn(2, 9, H)
    torch.testing.assert_close(ours(x), native(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_experts": 4, "top_k": 5}, "top_k must be between 1 and num_experts=4"),
        ({"num_experts": 4, "top_k": 0}, "top_k must be between 1"),
        ({"num_experts": 4, "capacity_factor": 0.0}, "capacity_factor must be > 0"),
        ({"num_experts": 4, "jitter_noise": 1.5}, "jitter_noise must be in [0, 1)"),
        ({"num_experts": 4, "hidden_act": "nope"}, "is not a transformers activation"),
    ],
)
def test_bad_configuration_names_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        MoELayer(H, INTER, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_runs_the_experts_in_the_autocast_dtype_with_weight_gradients_in_theirs(dtype):
    """Under autocast the grouped experts compute like an autocast Linear: in the autocast dtype, gradients back in
    the weights' fp32 (before: `mm(out=)` refused the fp32 output buffer of a bf16 product)."""
    torch.manual_seed(0)
    layer = MoELayer(H, INTER, num_experts=E, top_k=2)
    x = torch.randn(3, 7, H, requires_grad=True)
    params = [x, layer.gate.weight, layer.experts.gate_up_proj, layer.experts.down_proj]
    with torch.autocast("cpu", dtype=dtype):
        ours = layer(x)
        ref = per_token_reference(layer, x)  # the definition, each product autocast the same way
    grad_out = torch.randn_like(x)
    got = torch.autograd.grad(ours, params, grad_out)
    want = torch.autograd.grad(ref, params, grad_out)
    assert ours.dtype == dtype and all(g.dtype == torch.float32 for g in got)
    # the same products in `dtype`, summed in another order: within a few roundings of `dtype`
    tol = 8 * torch.finfo(dtype).eps
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.float(), atol=tol * w.abs().max().item(), rtol=tol)
