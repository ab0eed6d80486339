"""DKM's centroids advance once per optimizer step: every forward between two weight updates (gradient
accumulation's micro-batches, gradient checkpointing's recomputed forward) starts its k-means iterations from the
centroids the step started with, so it computes the same clustered weight; the refined centroids start the next
step. Without that, accumulating two half-batches was not one batch (each micro-batch iterated further) and a
recomputed forward differed from the one whose loss was taken."""

from __future__ import annotations

import pytest
import torch

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import DKMLinear, DKMSettings, quantize_model
from hf_llmkit.testing import tiny_llama


def _layer() -> DKMLinear:
    torch.manual_seed(0)
    layer = DKMLinear(48, 32, False, DKMSettings.build(32, bits=3, epsilon=1e-9, offload=False))
    torch.nn.init.normal_(layer.weight, std=0.02)
    layer.init_centroids()
    return layer.train()


def test_forwards_of_one_step_compute_the_same_weight_and_the_next_step_starts_refined():
    layer = _layer()
    x = torch.randn(3, 48)
    start = layer.centroids.clone()
    y1 = layer(x)
    refined = layer.centroids.clone()
    y2 = layer(x)  # same weights: a second micro-batch
    assert torch.equal(y1, y2) and torch.equal(layer.centroids, refined) and not torch.equal(refined, start)
    with torch.no_grad():
        layer.weight.add_(1e-4)  # an optimizer step
    layer(x)
    restarted = _layer()
    with torch.no_grad():
        restarted.weight.copy_(layer.weight)
    restarted(x)  # the same weights, iterating from the initial table instead of the refined one
    assert not torch.equal(layer.centroids, restarted.centroids)


def test_a_load_or_reinit_starts_a_new_step():
    layer = _layer()
    x = torch.randn(3, 48)
    layer(x)
    other = layer.centroids * 1.01
    layer.load_state_dict({"weight": layer.weight.detach().clone(), "centroids": other})
    y = layer(x)
    fresh = _layer()
    fresh.load_state_dict({"weight": layer.weight.detach().clone(), "centroids": other})
    assert torch.equal(y, fresh(x))  # iterated from the loaded table, not the step's old start


def test_gradient_checkpointing_recomputes_the_same_forward():
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    grads, tables = [], []
    for checkpointing in (False, True):
        model = quantize_model(tiny_llama(), DKMConfig(bits=3)).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        tables.append({n: b.clone() for n, b in model.named_buffers() if n.endswith("centroids")})
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
    for name in tables[0]:
        assert torch.equal(tables[0][name], tables[1][name]), name


def test_a_resumed_run_continues_a_step_that_left_the_weights_unchanged(tmp_path):
    """A checkpoint after a step that did not change the weights (lr 0 in warm-up, an fp16 step skipped on
    overflow) resumes into the same step: the next forward starts where the uninterrupted run's does."""
    from safetensors.torch import load_file

    from hf_llmkit.quantization import keep_training_state

    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    model = quantize_model(tiny_llama(), DKMConfig(bits=3)).train()
    model(input_ids=ids, labels=ids).loss.backward()  # step 1; its optimizer step leaves the weights as they are
    keep_training_state(model)
    model.save_pretrained(tmp_path)
    uninterrupted = model(input_ids=ids, labels=ids).loss
    resumed = quantize_model(tiny_llama(), DKMConfig(bits=3)).train()
    resumed.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert torch.equal(resumed(input_ids=ids, labels=ids).loss, uninterrupted)
    saved = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.mlp.up_proj.step_start" in saved and "model.layers.0.mlp.up_proj.step_key" in saved


def test_an_edited_step_state_is_refused_in_one_line():
    layer = _layer()
    state = {"weight": layer.weight.detach().clone(), "centroids": layer.centroids.clone()}
    state["step_start"], state["step_key"] = torch.zeros(1, 4, 1), torch.zeros(2)
    with pytest.raises(ValueError, match=r"'step_start' \(shape \(1, 4, 1\)\) is not a finite tensor of shape"):
        layer.load_state_dict(state)
    state["step_start"] = torch.full((1, 8, 1), float("nan"))
    with pytest.raises(ValueError, match="'step_start'.*the checkpoint is corrupt"):
        layer.load_state_dict(state)
