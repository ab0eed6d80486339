"""`DKMConfig(training_forward=...)`: what a training forward computes, DKM's soft assignment or the hard assignment
with straight-through gradients; "auto" is soft for `recipe="dkm"` and straight-through for `recipe="calibrated"`,
the soft one from the calibrated start keeps its tables and block scales, and a bad value names the choices."""

from __future__ import annotations

import pytest
import torch

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import DKMLinear, keep_training_state, quantize_model
from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.testing import tiny_llama


def _forwards(config: DKMConfig):
    """(training forward, evaluation forward, the first layer's latent-weight gradient, the layer) of a tiny Llama."""
    torch.manual_seed(0)
    model = quantize_model(tiny_llama(num_hidden_layers=1), config)
    keep_training_state(model, False)  # a loop of its own, no checkpoints (the recipe's calibration is not run here)
    ids = torch.randint(0, 256, (2, 12))
    layer = model.model.layers[0].mlp.up_proj
    tables, scales = layer.centroids.clone(), None if layer.scales is None else layer.scales.clone()
    model.train()
    trained = model(input_ids=ids).logits
    trained.square().sum().backward()
    assert torch.equal(layer.centroids, tables)  # no iterations here: the tables stay
    assert scales is None or torch.equal(layer.scales, scales)
    with torch.no_grad():
        evaluated = model.eval()(input_ids=ids).logits
    return trained.detach(), evaluated, layer.weight.grad, layer


@pytest.mark.parametrize(
    "options, straight",
    [
        ({}, False),
        ({"recipe": "calibrated", "scale_block_size": 16}, True),
        ({"recipe": "calibrated", "scale_block_size": 16, "training_forward": "soft"}, False),
        ({"training_forward": "straight_through", "dkm_iters": 0}, True),
    ],
    ids=["dkm: soft", "calibrated: straight-through", "calibrated, soft", "dkm, straight-through"],
)
def test_the_training_forward_is_what_training_forward_says(options, straight):
    config = DKMConfig(bits=3, dkm_iters=0, **{k: v for k, v in options.items() if k != "dkm_iters"})
    assert config.straight_through is straight
    trained, evaluated, grad, layer = _forwards(config)
    assert isinstance(layer, DKMLinear) and grad is not None and grad.abs().sum() > 0
    assert torch.equal(trained, evaluated) is straight  # straight-through trains the saved model's forward


def test_a_bad_training_forward_names_the_choices():
    with pytest.raises(ValueError, match=r"training_forward must be one of \('auto', 'soft', 'straight_through'\)"):
        DKMConfig(training_forward="hard")
    config = DKMConfig(recipe="calibrated", training_forward="soft")
    assert DKMConfig.from_dict(config.to_dict()) == config  # saved in config.json, rebuilt exactly


@pytest.mark.parametrize("fused", [True, False], ids=["fused AdamW", "AdamW"])
def test_a_straight_through_forward_after_an_optimizer_step_decodes_the_stepped_weights(fused):
    """Issue 52: a fused optimizer (the Trainer's default `adamw_torch_fused`) writes the latent weights without
    moving their version counter, so the cached hard weight stayed the first step's: every later training forward
    (and an evaluation) of `recipe="calibrated"` decoded stale weights, and a resumed run, decoding the loaded ones,
    ended elsewhere than the uninterrupted one."""
    torch.manual_seed(0)
    model = quantize_model(tiny_llama(num_hidden_layers=1), DKMConfig(bits=3, recipe="calibrated"))
    keep_training_state(model, False)
    layer = model.model.layers[0].mlp.up_proj
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused)
    ids = torch.randint(0, 256, (2, 12))
    model.train()
    model(input_ids=ids).logits.square().sum().backward()
    before = layer.hard_weight(torch.float32).clone()
    optimizer.step()
    vectors, table, scales = layer._hard_inputs()
    fresh = dkm.hard_decode(vectors, table, layer.weight.shape, scales)  # the stepped weights, decoded anew
    assert not torch.equal(fresh, before)  # the step moved some weight to another table entry
    assert torch.equal(layer.hard_weight(torch.float32), fresh)
