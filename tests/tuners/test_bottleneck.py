"""Bottleneck adapters: the math of each placement, default targets per model family, and bad input."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from torch import nn

from hf_llmkit import BottleneckConfig
from hf_llmkit.testing import tiny_llama, tiny_model
from hf_llmkit.tuners.bottleneck import BottleneckLayer

EXPECTED_TARGETS = {  # per family: (houlsby, pfeiffer, parallel) suffixes of layer 0's targeted modules
    "llama": (["mlp.down_proj", "self_attn.o_proj"], ["mlp.down_proj"], ["mlp"]),
    "mistral": (["mlp.down_proj", "self_attn.o_proj"], ["mlp.down_proj"], ["mlp"]),
    "qwen2": (["mlp.down_proj", "self_attn.o_proj"], ["mlp.down_proj"], ["mlp"]),
    "gpt2": (["attn.c_proj", "mlp.c_proj"], ["mlp.c_proj"], ["mlp"]),
    "bert": (["attention.output.dense", "output.dense"], ["0.output.dense"], ["0.output.dense"]),
}


@pytest.mark.parametrize("family", list(EXPECTED_TARGETS))
@pytest.mark.parametrize("index", [0, 1, 2], ids=["houlsby", "pfeiffer", "parallel"])
def test_default_targets_per_family(family, index):
    placement = ("houlsby", "pfeiffer", "parallel")[index]
    model = tiny_model(family)
    ids = torch.randint(1, 100, (2, 8))
    with torch.no_grad():
        base = model(input_ids=ids)[0]
        peft_model = get_peft_model(model, BottleneckConfig(placement=placement, bottleneck_size=4))
        assert torch.equal(peft_model(input_ids=ids)[0], base)  # zero-init up projection: unchanged outputs
    layer0 = sorted(n for n in peft_model.base_model.targeted_module_names if ".0." in n)
    expected = EXPECTED_TARGETS[family][index]
    assert len(layer0) == len(expected) and all(n.endswith(e) for n, e in zip(layer0, expected)), layer0
    assert len(peft_model.base_model.targeted_module_names) == 2 * len(expected)  # both layers


@pytest.mark.parametrize("placement", ["houlsby", "pfeiffer", "parallel"])
def test_moe_families_adapt_the_whole_sparse_block(placement):
    """Mixtral / Qwen2-MoE (e.g. upcycled): the experts are fused tensors, so the adapters sit on the sparse block
    (hidden -> hidden), next to the attention output for Houlsby."""
    from hf_llmkit.parallel import upcycle_to_moe

    ids = torch.randint(1, 100, (2, 8))
    for dense in (tiny_llama(), tiny_model("qwen2")):
        model = upcycle_to_moe(dense, num_experts=4, top_k=2).eval()
        with torch.no_grad():
            base = model(input_ids=ids)[0]
            peft_model = get_peft_model(model, BottleneckConfig(placement=placement, bottleneck_size=4))
            assert torch.equal(peft_model(input_ids=ids)[0], base)
        layer0 = sorted(n for n in peft_model.base_model.targeted_module_names if ".0." in n)
        expected = ["mlp", "self_attn.o_proj"] if placement == "houlsby" else ["mlp"]
        assert len(layer0) == len(expected) and all(n.endswith(e) for n, e in zip(layer0, expected)), layer0
        block = peft_model.base_model.model.get_submodule(layer0[0])
        assert block.bottleneck_down["default"].in_features == 64 and block.bottleneck_up["default"].out_features == 64


def _one_layer(placement: str, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 12))
    config = BottleneckConfig(
        target_modules=["1"], placement=placement, bottleneck_size=3, init_weights=False, **kwargs
    )
    return get_peft_model(model, config)


def test_sequential_adapter_computes_h_plus_scaled_f_h_down_up():
    model = _one_layer("houlsby", non_linearity="gelu", scaling=0.5)
    layer: BottleneckLayer = model.base_model.model[1]
    x = torch.randn(5, 12)
    h = layer.base_layer(x)
    down, up = layer.bottleneck_down["default"], layer.bottleneck_up["default"]
    expected = h + 0.5 * up(nn.functional.gelu(down(h)))
    torch.testing.assert_close(layer(x), expected)


def test_parallel_adapter_reads_the_module_input_and_is_scaled():
    model = _one_layer("parallel")
    layer: BottleneckLayer = model.base_model.model[1]
    assert model.peft_config["default"].scaling == 4.0  # He et al.'s default scale for parallel adapters
    x = torch.randn(5, 12)
    down, up = layer.bottleneck_down["default"], layer.bottleneck_up["default"]
    expected = layer.base_layer(x) + 4.0 * up(torch.relu(down(x)))
    torch.testing.assert_close(layer(x), expected)


def test_reduction_factor_sets_the_width_and_layers_to_transform_selects_layers():
    model = get_peft_model(tiny_llama(), BottleneckConfig(reduction_factor=8, layers_to_transform=[1]))
    names = model.base_model.targeted_module_names
    assert names and all(".layers.1." in n for n in names)
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    assert layer.bottleneck_down["default"].out_features == 64 // 8


def test_bottleneck_larger_than_hidden_size_names_the_fix():
    with pytest.raises(ValueError, match=r"larger than its hidden size 64; use bottleneck_size <= 64"):
        get_peft_model(tiny_llama(), BottleneckConfig(bottleneck_size=65))
    with pytest.raises(ValueError, match="reduction_factor >= 1"):
        get_peft_model(tiny_llama(), BottleneckConfig(reduction_factor=0.5))


def test_target_modules_matching_nothing_lists_close_candidates():
    with pytest.raises(ValueError, match=r"'o_porj' -> did you mean \[.*'o_proj'"):
        get_peft_model(tiny_llama(), BottleneckConfig(target_modules=["down_proj", "o_porj"]))
    with pytest.raises(ValueError, match="regex target_modules"):
        get_peft_model(tiny_llama(), BottleneckConfig(target_modules=r".*\.nothing"))


def test_unknown_family_needs_explicit_targets():
    with pytest.raises(ValueError, match="pass target_modules"):
        get_peft_model(nn.Sequential(nn.Linear(4, 4)), BottleneckConfig())


def test_module_returning_a_tuple_is_refused_with_a_hint():
    model = get_peft_model(tiny_llama(), BottleneckConfig(target_modules=["self_attn"], bottleneck_size=4))
    with pytest.raises(TypeError, match="target its output projection"):
        model(input_ids=torch.randint(3, 100, (1, 4)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"placement": "sideways"}, "placement='sideways' is not supported"),
        ({"bottleneck_size": 8, "reduction_factor": 4}, "either bottleneck_size or reduction_factor"),
        ({"bottleneck_size": 0}, "bottleneck_size must be >= 1"),
        ({"non_linearity": "relu7"}, "non_linearity='relu7' is unknown"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
        ({"layers_pattern": "layers"}, "set layers_to_transform too"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BottleneckConfig(**kwargs)
