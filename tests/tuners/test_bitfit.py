"""BitFit: which biases train (all, the paper's subset, added ones), exact merging, and bad input."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from hf_llmkit import BitFitConfig
from hf_llmkit.testing import tiny_llama, tiny_model
from hf_llmkit.tuners.bitfit import BITFIT_PAPER_SUBSET, BitFitLayer


def _trainable(model) -> dict[str, int]:
    return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}


def test_default_trains_every_existing_bias_and_nothing_else():
    base = tiny_model("bert")
    n_bias = sum(p.numel() for n, p in base.named_parameters() if n.endswith(".bias"))
    model = get_peft_model(base, BitFitConfig())
    trainable = _trainable(model)
    assert sum(trainable.values()) == n_bias  # one delta per base bias (Linear and LayerNorm)
    assert all(".bitfit_bias." in n for n in trainable)
    assert any("LayerNorm" in n for n in trainable)


def test_the_papers_query_and_intermediate_subset():
    model = get_peft_model(tiny_model("bert"), BitFitConfig(target_modules=BITFIT_PAPER_SUBSET))
    layers = {n.split(".bitfit_bias")[0].split("layer.")[1] for n in _trainable(model)}
    assert layers == {
        "0.attention.self.query",
        "0.intermediate.dense",
        "1.attention.self.query",
        "1.intermediate.dense",
    }
    config = model.get_base_model().config
    assert sum(_trainable(model).values()) == 2 * (config.hidden_size + config.intermediate_size)


def test_gpt2_conv1d_and_layernorm_biases_merge_exactly():
    model = get_peft_model(tiny_model("gpt2"), BitFitConfig(init_weights=False))
    kinds = {type(m.get_base_layer()).__name__ for m in model.modules() if isinstance(m, BitFitLayer)}
    assert kinds == {"Conv1D", "LayerNorm"}  # the tied lm_head (no bias) is left alone
    for layer in (m for m in model.modules() if isinstance(m, BitFitLayer)):  # Conv1D's weight is [in, out]
        if type(layer.get_base_layer()).__name__ == "Conv1D":
            assert (layer.in_features, layer.out_features) == tuple(layer.get_base_layer().weight.shape)
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        merged = model.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-6, atol=1e-6)


def test_added_biases_on_llama_become_real_biases_when_merged(tmp_path):
    model = get_peft_model(tiny_llama(), BitFitConfig(add_missing_biases=True, init_weights=False))
    assert sum(_trainable(model).values()) == 2 * (64 + 32 + 32 + 64 + 128 + 128 + 64)  # q k v o gate up down
    assert model.base_model.model.lm_head.bias is None and "lm_head" not in str(model.base_model.targeted_module_names)
    assert model.base_model.undeclarable_biases() == []  # attention_bias and mlp_bias declare them all
    ids = torch.randint(3, 500, (2, 8))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        merged = model.merge_and_unload()
    q_proj = merged.model.layers[0].self_attn.q_proj
    assert type(q_proj) is torch.nn.Linear and q_proj.bias is not None
    torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-6, atol=1e-6)
    # the config now declares the biases, so the merged model survives save_pretrained / from_pretrained
    assert merged.config.attention_bias and merged.config.mlp_bias
    merged.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=1e-6, atol=1e-6)


def test_merging_added_biases_the_config_cannot_declare_warns():
    mistral = tiny_model("mistral", num_hidden_layers=1)
    model = get_peft_model(mistral, BitFitConfig(target_modules=["q_proj"], add_missing_biases=True))
    assert model.base_model.undeclarable_biases() == ["model.layers.0.self_attn.q_proj"]
    with pytest.warns(UserWarning, match="Keep the BitFit adapter"):
        model.merge_and_unload()


def test_qwen2_declares_no_added_bias_and_merges_its_own_biases_through_a_reload(tmp_path):
    """Qwen2 builds q/k/v with biases and o_proj / the MLP without, whatever its config says: the added ones are
    undeclarable (the main job refuses them with --merge_adapter); its own biases merge and reload exactly."""
    added = get_peft_model(tiny_model("qwen2", num_hidden_layers=1), BitFitConfig(add_missing_biases=True))
    assert sorted(n.rsplit(".", 1)[-1] for n in added.base_model.undeclarable_biases()) == [
        "down_proj", "gate_proj", "o_proj", "up_proj",
    ]  # fmt: skip
    model = get_peft_model(tiny_model("qwen2", num_hidden_layers=1), BitFitConfig(init_weights=False))
    assert model.base_model.undeclarable_biases() == []
    ids = torch.randint(3, 500, (2, 8))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        model.merge_and_unload().save_pretrained(tmp_path)
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, expected)


def test_unmerge_removes_a_bias_that_merge_created():
    model = get_peft_model(tiny_llama(), BitFitConfig(target_modules=["v_proj"], add_missing_biases=True))
    layer = model.base_model.model.model.layers[0].self_attn.v_proj
    model.merge_adapter()
    assert layer.base_layer.bias is not None
    model.unmerge_adapter()
    assert layer.base_layer.bias is None


def test_bias_less_targets_name_add_missing_biases():
    with pytest.raises(ValueError, match="set add_missing_biases=True"):
        get_peft_model(tiny_llama(), BitFitConfig(target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="set add_missing_biases=True"):
        get_peft_model(tiny_llama(), BitFitConfig())


def test_target_modules_matching_nothing_lists_close_candidates():
    with pytest.raises(ValueError, match=r"'qeury' -> did you mean \[.*'query'"):
        get_peft_model(tiny_model("bert"), BitFitConfig(target_modules=["qeury"]))


def test_config_validation():
    with pytest.raises(ValueError, match="pass None to train every bias"):
        BitFitConfig(target_modules=[])
    with pytest.raises(ValueError, match="set layers_to_transform too"):
        BitFitConfig(layers_pattern="layer")


def _train_steps(model, ids: torch.Tensor, steps: int = 3) -> torch.Tensor:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_on_linear_layers_bitfit_equals_peft_beft_bit_for_bit():
    """peft 0.21's BEFT is the same method on `nn.Linear` (a zero-initialised bias delta added to the output): the
    same biases train to the same values and outputs, bit for bit (docs/peft.md says what BitFit adds)."""
    from peft import BeftConfig

    targets = ["q_proj", "k_proj", "v_proj"]  # Qwen2's attention projections have biases
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = get_peft_model(tiny_model("qwen2"), BitFitConfig(target_modules=targets))
    theirs = get_peft_model(tiny_model("qwen2"), BeftConfig(target_modules=targets))
    assert _trainable(ours) == {n.replace("beft_bias", "bitfit_bias"): 64 if "q_proj" in n else 32
                                for n in _trainable(theirs)}  # fmt: skip
    assert torch.equal(_train_steps(ours, ids), _train_steps(theirs, ids))
    deltas = [p for n, p in ours.named_parameters() if p.requires_grad]
    peers = [p.flatten() for n, p in theirs.named_parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(deltas, peers)) and any(a.abs().sum() > 0 for a in deltas)


def test_what_bitfit_adds_over_beft():
    """BEFT takes `nn.Linear` only and, on a bias-less one, a delta it cannot merge; BitFit also trains LayerNorm and
    GPT-2 Conv1D biases, by default every existing bias, and merges an added bias into a real one."""
    from peft import BeftConfig

    with pytest.raises(TypeError, match="only `torch.nn.Linear` is supported"):
        get_peft_model(tiny_model("gpt2"), BeftConfig(target_modules=["c_attn", "ln_1"]))
    model = get_peft_model(tiny_model("gpt2"), BitFitConfig())  # every existing bias
    kinds = {type(m.get_base_layer()).__name__ for m in model.modules() if isinstance(m, BitFitLayer)}
    assert kinds == {"Conv1D", "LayerNorm"}
    merged = get_peft_model(tiny_llama(), BitFitConfig(add_missing_biases=True, init_weights=False))
    merged = merged.merge_and_unload()
    assert merged.model.layers[0].self_attn.q_proj.bias is not None  # a real bias now
