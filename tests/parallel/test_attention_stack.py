"""The shared attention stack: layers keep their place whatever the order they are added in, names round-trip
through transformers' registry, and a stack runs its layers outermost first (single process; the multi-rank
P-tuning v2 + Ulysses equivalence is in test_sequence.py)."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

from hf_llmkit import PTuningV2Config
from hf_llmkit.compat.transformers import configured_attention
from hf_llmkit.parallel.attention import (
    AttentionLayer,
    AttentionStack,
    add_attention_layer,
    attention_layer,
    head_sharded_kwargs,
    remove_attention_layer,
    stack_named,
)
from hf_llmkit.testing import tiny_llama
from hf_llmkit.tuners.ptuning_v2.attention import PREFIX_KWARG, PrefixAttention

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])


class Recorder(AttentionLayer):
    """An outer layer that records the calls it sees and scales the output (to prove it ran)."""

    kind = "recorder"
    order = 5
    name_prefix = "rec_"

    def __init__(self, factor: float = 1.0) -> None:
        self.factor, self.seen = factor, []

    def name_suffix(self) -> str:
        return f"x{self.factor:g}"

    def __call__(self, module, query, key, value, attention_mask, *, inner, kernel, **kwargs):
        self.seen.append((kernel, PREFIX_KWARG in kwargs))
        out, weights = inner(module, query, key, value, attention_mask, **kwargs)
        return out * self.factor, weights


def test_layers_take_their_place_whatever_the_order_and_names_round_trip():
    one = AttentionStack("sdpa").with_layer(PrefixAttention()).with_layer(Recorder(2))
    two = AttentionStack("sdpa").with_layer(Recorder(2)).with_layer(PrefixAttention())
    assert [layer.kind for layer in one.layers] == [layer.kind for layer in two.layers] == ["recorder", "ptuning_v2"]
    assert one.name == two.name == "rec_ptuning_v2_sdpax2"
    assert AttentionStack("flash_attention_2", (PrefixAttention(),)).name == "ptuning_v2_fa2"  # no "flash" in names
    assert AttentionStack("eager").name == "eager" and stack_named("sdpa") == AttentionStack("sdpa")
    assert one.without("recorder").name == "ptuning_v2_sdpa"
    assert head_sharded_kwargs()[PREFIX_KWARG] == 1  # Ulysses splits the prefix's kv heads


def test_outer_layer_sees_the_prefix_and_the_stack_survives_peft_in_either_order():
    base = tiny_llama()
    torch.manual_seed(0)
    peft_first = get_peft_model(base, PTuningV2Config(num_virtual_tokens=2)).eval()
    recorder = Recorder(1.0)
    add_attention_layer(peft_first, recorder)
    with torch.no_grad():
        expected = peft_first(input_ids=IDS).logits
    assert recorder.seen and recorder.seen[0] == ("sdpa", True)  # outside the prefix layer: the prefix is a kwarg
    assert configured_attention(peft_first.config) == "rec_ptuning_v2_sdpax1"

    base = add_attention_layer(tiny_llama(), Recorder(1.0))
    torch.manual_seed(0)
    layer_first = get_peft_model(base, PTuningV2Config(num_virtual_tokens=2)).eval()
    assert configured_attention(layer_first.config) == "rec_ptuning_v2_sdpax1"
    with torch.no_grad():
        torch.testing.assert_close(layer_first(input_ids=IDS).logits, expected, rtol=0, atol=0)
    with layer_first.disable_adapter():  # the prefix layer leaves; the outer layer stays
        assert configured_attention(layer_first.config) == "rec_sdpax1"
    remove_attention_layer(layer_first, "recorder")
    assert configured_attention(layer_first.config) == "ptuning_v2_sdpa"
    assert attention_layer(layer_first, "recorder") is None
    assert isinstance(attention_layer(layer_first.config, "ptuning_v2"), PrefixAttention)


def test_an_outer_layer_changes_the_output_and_removal_restores_the_kernel():
    model = tiny_llama()
    with torch.no_grad():
        plain = model(input_ids=IDS).logits
        add_attention_layer(model, Recorder(0.0))  # attention output zeroed: logits must change
        assert not torch.allclose(model(input_ids=IDS).logits, plain)
        remove_attention_layer(model, "recorder")
        assert configured_attention(model.config) == "sdpa"
        torch.testing.assert_close(model(input_ids=IDS).logits, plain, rtol=0, atol=0)


def test_layers_refuse_what_they_cannot_wrap():
    with pytest.raises(ValueError, match="'no_such_kernel' is not registered"):
        AttentionStack("no_such_kernel").with_layer(PrefixAttention())
    with pytest.raises(TypeError, match="wrap transformers PreTrainedModels"):
        add_attention_layer(torch.nn.Linear(2, 2), Recorder())
