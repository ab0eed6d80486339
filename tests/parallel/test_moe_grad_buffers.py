"""The experts' reused gradient memory never overwrites a gradient somebody still holds."""

import copy

import torch

from hf_llmkit.parallel import MoELayer


def _layer() -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(8, 16, num_experts=4, top_k=2)


def _backward(layer: MoELayer, seed: int) -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
    layer(x).square().sum().backward()


def _grads(layer: MoELayer) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.experts.gate_up_proj.grad, layer.experts.down_proj.grad


def test_dropped_gradient_memory_is_reused_with_the_same_values():
    layer = _layer()
    _backward(layer, 1)
    first = [g.clone() for g in _grads(layer)]
    pointers = [g.data_ptr() for g in _grads(layer)]
    layer.zero_grad(set_to_none=True)
    _backward(layer, 1)
    assert [g.data_ptr() for g in _grads(layer)] == pointers  # no fresh pages for the next step
    assert all(torch.equal(a, b) for a, b in zip(first, _grads(layer)))


def test_gradients_kept_for_accumulation_are_not_overwritten():
    layer, reference = _layer(), _layer()
    _backward(layer, 1)
    _backward(layer, 2)  # accumulates into the kept .grad: the second backward must not reuse its memory
    _backward(reference, 1)
    first = [g.clone() for g in _grads(reference)]
    reference.zero_grad(set_to_none=True)
    _backward(reference, 2)
    for accumulated, a, b in zip(_grads(layer), first, _grads(reference)):
        torch.testing.assert_close(accumulated, a + b)


def test_gradients_returned_by_autograd_grad_stay_valid_while_held():
    layer = _layer()
    params = [layer.experts.gate_up_proj, layer.experts.down_proj]
    held = []
    for seed in (1, 2):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
        held.append(torch.autograd.grad(layer(x).square().sum(), params))
    copies = [[g.clone() for g in grads] for grads in held]
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    torch.autograd.grad(layer(x).square().sum(), params)
    assert held[0][0].data_ptr() != held[1][0].data_ptr()
    assert all(torch.equal(g, c) for grads, cs in zip(held, copies) for g, c in zip(grads, cs))


def test_a_copied_layer_gets_its_own_gradient_memory():
    layer = _layer()
    _backward(layer, 1)
    layer.zero_grad(set_to_none=True)
    twin = copy.deepcopy(layer)
    _backward(layer, 1)
    _backward(twin, 1)
    assert _grads(layer)[0].data_ptr() != _grads(twin)[0].data_ptr()
    assert torch.equal(_grads(layer)[0], _grads(twin)[0])
