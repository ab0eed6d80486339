"""eDKM marshaling: saved-for-backward storages are stored once (views rebuilt), gradients unchanged."""

from __future__ import annotations

import torch

from hf_llmkit.quantization import MarshalHooks
from hf_llmkit.quantization.layers import DKMLinear, DKMSettings


def _naive_layer(offload: bool) -> DKMLinear:
    torch.manual_seed(0)
    settings = DKMSettings.build(64, bits=3, uniquify=False, offload=offload, epsilon=1e-9)
    layer = DKMLinear(64, 32, False, settings)
    layer.init_centroids()
    return layer.train()


def test_views_of_one_tensor_are_stored_once():
    a = torch.randn(256, 64, requires_grad=True)
    with MarshalHooks() as hooks:
        b = a.exp()  # exp saves its output b
        c = b.t() @ b  # mm saves the view b.t() and b again: same storage
        loss = (c.sin()).sum()  # sin saves c
    assert hooks.stats.saved_tensors >= 3
    assert hooks.stats.stored_bytes < hooks.stats.requested_bytes
    assert hooks.stats.storages < hooks.stats.saved_tensors
    loss.backward()
    expected = torch.autograd.grad((a.exp().t() @ a.exp()).sin().sum(), a)[0]
    assert torch.allclose(a.grad, expected)


def test_dkm_layer_saves_fewer_bytes_with_marshaling_same_gradients():
    x = torch.randn(8, 64)
    plain, marshaled = _naive_layer(False), _naive_layer(True)
    # Count what autograd saves without marshaling: a pass-through meter that dedupes nothing.
    with MarshalHooks(offload=False, exclude=(x,)) as meter:
        y0 = plain(x)
    y0.square().sum().backward()
    y1 = marshaled(x)
    y1.square().sum().backward()
    stats = marshaled.last_marshal
    assert stats.requested_bytes == meter.stats.requested_bytes > 0
    assert stats.stored_bytes < stats.requested_bytes  # the dedup: bytes held for backward drop
    assert stats.offloaded_bytes == 0  # CPU tensors stay where they are
    assert torch.equal(y0, y1)
    assert torch.allclose(plain.weight.grad, marshaled.weight.grad)


def test_parameters_and_excluded_inputs_are_not_counted():
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    with MarshalHooks(exclude=(x,)) as hooks:
        y = x @ w
    y.sum().backward()
    assert hooks.stats.saved_tensors == 0 and hooks.stats.skipped_bytes > 0
    assert torch.allclose(w.grad, x.t() @ torch.ones(4, 16))
