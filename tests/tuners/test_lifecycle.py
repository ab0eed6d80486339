"""The PEFT lifecycle battery: every method x model family of `lifecycle_cases.CASES` through peft's adapter lifecycle.

In the style of peft's tests/testing_common.py (written here): one check per function, parametrized over the case
table, peft's LoRA run as the reference row. This file: refusals, trainable parameters and their counts,
`inference_mode`, several adapters, merging / unloading, fp16 / bf16 with activation checkpointing.
test_lifecycle_saving.py: `modules_to_save`, saving and reloading (in a fresh process). A cell that makes no sense
is refused in one line by the library (`test_refused_cells_say_what_to_do`) or skipped with the case table's reason.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers import Conv1D

from tests.tuners.lifecycle_cases import CASES, FAMILIES, METHODS, RUNS, make_model
from tests.tuners.lifecycle_checks import (
    no_peft_modules_left,
    outputs,
    refuses_in_one_line,
    snapshot,
    train_step,
    trainable,
)


def _params(cases):
    return [pytest.param(case, id=case.id) for case in cases]


def _skipped_or(case):
    if case.skip_reason:
        pytest.skip(case.skip_reason)
    assert case.refusal is None


ALL = _params([c for c in CASES if c.refusal is None])  # skipped cells show up as skips, with their reason
MERGEABLE = _params([c for c in RUNS if METHODS[c.method].merge_error is None])
UNMERGEABLE = _params([c for c in RUNS if METHODS[c.method].merge_error is not None])


@pytest.mark.parametrize("case", _params([c for c in CASES if c.refusal]))
def test_refused_cells_say_what_to_do(case):
    config = METHODS[case.method].config(case.family)
    refuses_in_one_line(case.refusal, lambda: get_peft_model(make_model(case.family), config))


def _features(base: nn.Module) -> tuple[int, int]:
    """The (in, out) a peft layer reports for `base`, worked out from the module itself."""
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    if isinstance(base, Conv1D):
        return base.weight.shape[0], base.weight.shape[1]  # weight is [in, out]
    if isinstance(base, nn.LayerNorm):
        return base.normalized_shape[0], base.normalized_shape[0]
    if isinstance(base, nn.Embedding):
        return base.num_embeddings, base.embedding_dim
    if hasattr(base, "layer_idx"):  # an attention module: hidden states in, hidden states out
        return base.config.hidden_size, base.config.hidden_size
    linears = [m for m in base.modules() if isinstance(m, nn.Linear)]  # a block: its first input, its last output
    return linears[0].in_features, linears[-1].out_features


@pytest.mark.parametrize("case", ALL)
def test_trainable_parameters_counts_and_features(case, capsys):
    _skipped_or(case)
    method, inputs = METHODS[case.method], METHODS[case.method].inputs(case.family)
    model = get_peft_model(make_model(case.family), method.config(case.family, init=True))
    if method.identity_at_init:
        torch.testing.assert_close(outputs(model, inputs), outputs(make_model(case.family), inputs), rtol=0, atol=0)
    prefix = model.base_model.prefix
    names = trainable(model)
    assert names and all(prefix in n for n in names), sorted(names)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    assert model.get_nb_trainable_parameters() == (n_trainable, n_all)
    model.print_trainable_parameters()
    assert f"trainable params: {n_trainable:,} || all params: {n_all:,}" in capsys.readouterr().out
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers and all((m.in_features, m.out_features) == _features(m.get_base_layer()) for m in layers)
    before = snapshot(model)
    train_step(model, inputs)
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert moved and moved <= names, sorted(moved - names)  # the adapter trains, nothing else moves

    frozen = get_peft_model(make_model(case.family), method.config(case.family, inference_mode=True))
    assert not trainable(frozen) and frozen.get_nb_trainable_parameters()[0] == 0
    frozen.print_trainable_parameters()
    assert "trainable params: 0 ||" in capsys.readouterr().out
    assert torch.isfinite(outputs(frozen, inputs)).all()


@pytest.mark.parametrize("case", ALL)
def test_several_adapters_add_set_disable_delete(case):
    _skipped_or(case)
    method, family = METHODS[case.method], case.family
    first, second = method.inputs(family, 0), method.inputs(family, 1)
    plain = FAMILIES[family].inputs()  # no virtual tokens: what the base model reads
    base = make_model(family)
    model = get_peft_model(make_model(family), method.config(family))
    out_default = outputs(model, first)
    assert not torch.allclose(out_default, outputs(base, plain))  # the adapter acts
    model.add_adapter("other", method.config(family, slot=1))
    # adding an adapter neither activates it nor makes it trainable
    torch.testing.assert_close(outputs(model, first), out_default, rtol=0, atol=0)
    assert not any(".other" in n for n in trainable(model))
    model.set_adapter("other")
    out_other = outputs(model, second)
    assert not torch.allclose(out_other, out_default) and not torch.allclose(out_other, outputs(base, plain))
    assert trainable(model) and all(".other" in n for n in trainable(model))
    with model.disable_adapter():
        torch.testing.assert_close(outputs(model, plain), outputs(base, plain), rtol=0, atol=0)
        if method.name == "ptuning":  # virtual tokens cannot be read with the adapter off
            refuses_in_one_line(r"is a virtual token .* no P-tuning adapter is active", lambda: outputs(model, first))
    torch.testing.assert_close(outputs(model, second), out_other, rtol=0, atol=0)
    model.set_adapter("default")
    torch.testing.assert_close(outputs(model, first), out_default, rtol=0, atol=0)
    model.delete_adapter("other")
    assert not any(".other" in n for n, _ in model.named_parameters()) and list(model.peft_config) == ["default"]
    torch.testing.assert_close(outputs(model, first), out_default, rtol=0, atol=0)
    if method.overlap:  # two adapters on the same virtual tokens cannot coexist: one line, nothing changed
        refuses_in_one_line(method.overlap, lambda: model.add_adapter("clash", method.config(family)))
        assert list(model.peft_config) == ["default"]
        torch.testing.assert_close(outputs(model, first), out_default, rtol=0, atol=0)


@pytest.mark.parametrize("case", MERGEABLE)
def test_merge_unmerge_safe_merge_and_unload_are_exact(case):
    method, family = METHODS[case.method], case.family
    inputs = method.inputs(family)
    base_out = outputs(make_model(family), inputs)
    model = get_peft_model(make_model(family), method.config(family))
    expected = outputs(model, inputs)
    model.merge_adapter()
    assert all(m.merged for m in model.modules() if isinstance(m, BaseTunerLayer))
    torch.testing.assert_close(outputs(model, inputs), expected, rtol=1e-4, atol=1e-4)
    model.unmerge_adapter()
    torch.testing.assert_close(outputs(model, inputs), expected, rtol=1e-4, atol=1e-4)
    merged = copy.deepcopy(model).merge_and_unload(safe_merge=True)
    assert no_peft_modules_left(merged)
    torch.testing.assert_close(outputs(merged, inputs), expected, rtol=1e-4, atol=1e-4)
    unloaded = model.unload()  # the base weights went through a merge and an unmerge: equal up to rounding
    assert no_peft_modules_left(unloaded)
    torch.testing.assert_close(outputs(unloaded, inputs), base_out, rtol=1e-4, atol=1e-4)

    broken = get_peft_model(make_model(family), method.config(family))
    for p in broken.parameters():
        if p.requires_grad:
            p.data.view(-1)[0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        broken.merge_and_unload(safe_merge=True)


@pytest.mark.parametrize("case", UNMERGEABLE)
def test_merge_is_refused_in_one_line_and_unload_gives_the_base(case):
    method, family = METHODS[case.method], case.family
    inputs = method.inputs(family)
    model = get_peft_model(make_model(family), method.config(family))
    expected, state = outputs(model, inputs), copy.deepcopy(model.state_dict())
    refuses_in_one_line(method.merge_error, model.merge_and_unload)
    refuses_in_one_line(method.merge_error, lambda: model.merge_and_unload(safe_merge=True))
    refuses_in_one_line(method.merge_error, model.merge_adapter)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # the failed merges changed nothing
    torch.testing.assert_close(outputs(model, inputs), expected, rtol=0, atol=0)
    unloaded = model.unload()
    assert no_peft_modules_left(unloaded)
    plain = FAMILIES[family].inputs()
    torch.testing.assert_close(outputs(unloaded, plain), outputs(make_model(family), plain), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", ALL)
def test_half_precision_forward_backward_with_checkpointing(case, dtype):
    """The base in fp16 / bf16 (adapters in fp32, peft's default), activation checkpointing on where the family has
    it, `modules_to_save` on one module: backward reaches every trainable parameter and nothing else; mergeable
    methods merge in that precision (the path issue 23 found broken)."""
    _skipped_or(case)
    method, family = METHODS[case.method], case.family
    spec = FAMILIES[family]
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in method.inputs(family).items()}
    base = make_model(family).to(dtype)
    if spec.checkpointing:
        base.activation_checkpointing_enable()
    config = method.config(family, modules_to_save=[spec.one_module])
    model = get_peft_model(base, config).train()
    if spec.checkpointing:
        assert model.get_base_model().is_activation_checkpointing
    outputs(model, inputs, grad=True).float().pow(2).mean().backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        else:
            assert p.grad is None, name
    assert any(p.grad.abs().sum() > 0 for p in model.parameters() if p.grad is not None)
    model.eval()
    expected = outputs(model, inputs)
    assert torch.isfinite(expected).all()
    if method.merge_error:
        refuses_in_one_line(method.merge_error, model.merge_and_unload)
    else:
        merged = model.merge_and_unload(safe_merge=True)
        assert no_peft_modules_left(merged)
        torch.testing.assert_close(outputs(merged, inputs).float(), expected.float(), rtol=0.05, atol=0.05)
