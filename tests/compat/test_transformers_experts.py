"""The experts registry internals `experts_implementation="llmkit"` reads (hf_llmkit.compat.transformers): the
layout flags and default gating hook of transformers' experts classes, and what its MoE routers return."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import MixtralConfig, Qwen2MoeConfig
from transformers.integrations.moe import ExpertsInterface
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from hf_llmkit.compat.transformers import CHECKED_AGAINST, experts_layout_problem, router_logits_and_experts
from hf_llmkit.parallel.moe.registry import EXPERTS_IMPLEMENTATION, llmkit_experts_forward

FIX = (
    f"transformers {transformers.__version__} changed it (checked against {CHECKED_AGAINST}): update "
    "hf_llmkit.compat.transformers"
)
SHAPE = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)
BLOCKS = {
    "mixtral": (MixtralSparseMoeBlock, MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (
        Qwen2MoeSparseMoeBlock,
        Qwen2MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    ),
}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_native_experts_have_the_layout_we_compute_and_routers_return_logits_and_experts(name):
    block_cls, config = BLOCKS[name]
    block = block_cls(config)
    assert experts_layout_problem(block.experts) is None, FIX  # fused [gate | up], no bias, default gating
    x = torch.randn(5, 16)
    logits, experts = router_logits_and_experts(block.gate(x))
    assert logits.shape == (5, 4) and experts.shape == (5, 2) and not experts.is_floating_point(), FIX


def test_llmkit_is_registered_and_other_layouts_are_refused_in_one_line():
    assert ExpertsInterface()[EXPERTS_IMPLEMENTATION] is llmkit_experts_forward  # importing hf_llmkit registered it
    experts = MixtralSparseMoeBlock(BLOCKS["mixtral"][1]).experts
    experts.has_bias = True  # what the decorator sets for experts with biases (e.g. GPT-OSS)
    with pytest.raises(ValueError) as refused:
        llmkit_experts_forward(experts, torch.randn(3, 16), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
    message = str(refused.value)
    assert "has biases" in message and "experts_implementation='grouped_mm'" in message and "\n" not in message
