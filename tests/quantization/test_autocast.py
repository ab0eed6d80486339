"""DKM under mixed precision: every engine works inside `torch.autocast` (bf16 and fp16) like `nn.Linear` does, with
and without block scales.

The product `x @ W_c^T` runs in autocast's dtype (the output has it, as `F.linear`'s does), while DKM's own math keeps
the latent weight's and the tables' precision: the centroids a step computes are bit for bit those of the same step
without autocast, the latent weight and its gradient keep their dtype, and the gradient matches the fp32 one to 16-bit
rounding. A Trainer with `bf16=True` trains a DKM model end to end (it used to fail in backward with
"expected m1 and m2 to have the same dtype").
"""

from __future__ import annotations

import pytest
import torch

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import DKMLinear, DKMSettings, quantize_model
from hf_llmkit.testing import tiny_llama, tiny_training_args

# case -> (latent weight dtype, DKMConfig options pinning the engine)
ENGINES = {
    "naive": (torch.float32, {"engine": "naive"}),
    "bucketed": (torch.float32, {"engine": "bucketed"}),
    "table": (torch.bfloat16, {"engine": "table"}),
    "table_vectors": (torch.float32, {"engine": "table", "cluster_dim": 2}),
    # block scales (`scale_block_size`): the table clusters the normalised latent weight, then the scales multiply back
    "interval_block_scales": (torch.float32, {"engine": "interval", "scale_block_size": 16}),
    "table_block_scales": (torch.bfloat16, {"engine": "table", "scale_block_size": 16}),
}


def _layer(engine: str) -> DKMLinear:
    dtype, options = ENGINES[engine]
    torch.manual_seed(0)
    layer = DKMLinear(64, 32, True, DKMSettings.build(32, bits=3, offload=False, **options), dtype=dtype)
    torch.nn.init.normal_(layer.weight, std=0.02)
    layer.init_centroids()
    return layer.train()


def _step(layer: DKMLinear, x: torch.Tensor, amp: torch.dtype | None):
    layer.weight.grad = x.grad = None
    start = layer.centroids.clone()
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        y = layer(x)
    (y.float().square().sum()).backward()
    assert x.grad.dtype == x.dtype  # the input gradient flows back (it failed here in backward)
    cents = layer.centroids.clone()
    layer.centroids.copy_(start)  # the next step starts from the same table
    return y, layer.weight.grad.clone(), cents


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_every_engine_under_autocast(engine, amp):
    layer = _layer(engine)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    y_ref, g_ref, c_ref = _step(layer, x, None)
    y, g, c = _step(layer, x, amp)
    assert y.dtype == amp  # as nn.Linear's output under autocast
    assert layer.weight.dtype == ENGINES[engine][0] and g.dtype == layer.weight.dtype
    assert layer.centroids.dtype == torch.float32
    assert torch.equal(c, c_ref)  # DKM's k-means ran in the tables' precision, not autocast's
    assert ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item() < 2e-2
    assert ((g.float() - g_ref.float()).abs().max() / g_ref.float().abs().max()).item() < 3e-2


def test_backward_called_inside_autocast():
    """A backward run inside the autocast region (some loops do) gives the same gradient: the bucketed engine's
    backward (the fp32 default, one autograd Function) keeps its float32 matmuls. (Built-in ops' backward follows
    torch's own autocast rules, which recommend calling backward outside the region.)"""
    layer = _layer("bucketed")
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    _, g_out, _ = _step(layer, x, torch.bfloat16)
    layer.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x).float().square().sum().backward()
    assert torch.equal(layer.weight.grad, g_out)


def test_trainer_bf16_trains_a_dkm_model(tmp_path):
    """`Trainer(bf16=True)` (CPU autocast; accelerate runs fp16 without autocast on CPU) on a `DKMConfig(bits=3)`
    model."""
    from transformers import Trainer

    model = quantize_model(tiny_llama(), DKMConfig(bits=3))
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    before = model.model.layers[0].mlp.down_proj.centroids.clone()
    args = tiny_training_args(tmp_path, max_steps=2, bf16=True)
    result = Trainer(model=model, args=args, train_dataset=data).train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, DKMLinear) and layer.weight.dtype == torch.float32
    assert not torch.equal(layer.centroids, before)
