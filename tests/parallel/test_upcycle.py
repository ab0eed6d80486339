"""upcycle_to_moe: dense equivalence, export to transformers' native MoE checkpoints, bad input."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hf_llmkit.parallel import MoELayer, moe_blocks, moe_layers
from hf_llmkit.parallel.moe.upcycle import upcycle_to_moe, use_moe_layers
from hf_llmkit.testing import tiny_llama, tiny_llama_config

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def dense_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(**SHAPE, num_key_value_heads=2, sliding_window=8)).eval()
    qwen2 = Qwen2ForCausalLM(Qwen2Config(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True)).eval()
    return {"llama": tiny_llama(), "mistral": mistral, "qwen2": qwen2}


EXPECTED = {
    "llama": ("MixtralForCausalLM", "MixtralSparseMoeBlock"),
    "mistral": ("MixtralForCausalLM", "MixtralSparseMoeBlock"),
    "qwen2": ("Qwen2MoeForCausalLM", "Qwen2MoeSparseMoeBlock"),
}
IDS = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))  # longer than Mistral's window


@torch.no_grad()
def test_upcycled_models_equal_dense_then_export_to_native_moe_in_a_fresh_process(tmp_path):
    logits = {}
    for name, dense in dense_models().items():
        reference = dense(IDS).logits
        moe = upcycle_to_moe(dense, num_experts=4, top_k=2)
        assert type(moe).__name__ == EXPECTED[name][0]
        # transformers' own sparse blocks, computing through our experts implementation
        assert [type(block).__name__ for block in moe_blocks(moe)] == [EXPECTED[name][1]] * 2
        assert moe.config._experts_implementation == "llmkit" and not moe_layers(moe)
        torch.testing.assert_close(moe(IDS).logits, reference, atol=1e-5, rtol=1e-5)
        # Make the experts and the router differ (as after training) so the export check is not trivial.
        for layer in moe_blocks(moe):
            for p in (layer.gate.weight, layer.experts.gate_up_proj, layer.experts.down_proj):
                p.add_(torch.randn_like(p) * 0.05)
        logits[name] = moe(IDS).logits
        assert not torch.allclose(logits[name], reference, atol=1e-3)
        moe.save_pretrained(tmp_path / name)
    torch.save(IDS, tmp_path / "ids.pt")

    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        for name in {list(EXPECTED)!r}:
            model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r} + "/" + name).eval()
            with torch.no_grad():
                out = model(ids).logits
            torch.save(
                (type(model).__name__, type(model.model.layers[0].mlp).__name__, out),
                {str(tmp_path)!r} + "/" + name + ".out",
            )
        assert not any(m.startswith("hf_llmkit") for m in sys.modules), "hf_llmkit was imported"
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300, cwd=tmp_path)
    for name in EXPECTED:
        model_cls, block_cls, out = torch.load(tmp_path / f"{name}.out")
        assert (model_cls, block_cls) == EXPECTED[name]
        torch.testing.assert_close(out, logits[name], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_native_checkpoint_back_to_moe_layers(tmp_path):
    moe = upcycle_to_moe(tiny_llama(), num_experts=4, top_k=2, capacity_factor=8.0)  # capacity: MoELayer blocks
    assert len(moe_layers(moe)) == 2 and moe_blocks(moe) == moe_layers(moe)
    for layer in moe_layers(moe):
        layer.experts.down_proj.add_(torch.randn_like(layer.experts.down_proj) * 0.05)
    expected = moe(IDS).logits
    moe.save_pretrained(tmp_path)
    from transformers import MixtralForCausalLM

    native = MixtralForCausalLM.from_pretrained(tmp_path).eval()
    use_moe_layers(native, capacity_factor=8.0)
    assert all(isinstance(layer.mlp, MoELayer) for layer in native.model.layers)
    torch.testing.assert_close(native(IDS).logits, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no Mixtral or Qwen2-MoE sparse blocks"):
        use_moe_layers(tiny_llama())


@torch.no_grad()
def test_qwen2_shared_expert_starts_silent():
    dense = dense_models()["qwen2"]
    reference = dense(IDS).logits
    moe = upcycle_to_moe(dense, num_experts=4, top_k=1, shared_expert_intermediate_size=32)
    assert moe.config.shared_expert_intermediate_size == 32
    torch.testing.assert_close(moe(IDS).logits, reference, atol=1e-5, rtol=1e-5)


def test_bad_input_names_the_fix():
    tiny_gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*supported architectures: llama, mistral, qwen2"):
        upcycle_to_moe(tiny_gpt2, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="attention_bias=False"):
        upcycle_to_moe(tiny_llama(attention_bias=True), num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="top_k must be between 1 and num_experts=2"):
        upcycle_to_moe(tiny_llama(), num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="Qwen2 models"):
        upcycle_to_moe(tiny_llama(), num_experts=4, shared_expert_intermediate_size=8)
    assert tiny_llama_config().model_type == "llama"


def test_a_quantized_model_is_refused_upcycle_first():
    from hf_llmkit import DKMConfig
    from hf_llmkit.quantization import quantize_model

    quantized = quantize_model(tiny_llama(), DKMConfig(bits=2, kmeans_iters=1))
    with pytest.raises(ValueError, match=r"\(dkm\): upcycle the unquantized model first, then quantize_model"):
        upcycle_to_moe(quantized, num_experts=4, top_k=2)


@torch.no_grad()
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_router_logits_and_load_balancing_loss_equal_the_native_moe_model(name, tmp_path):
    """`output_router_logits=True` (what TRL's SFTTrainer turns on for MoE configs) collects every MoELayer's router
    logits, so the model's load-balancing loss is the one transformers' own MoE model computes from the same
    weights."""
    moe = upcycle_to_moe(dense_models()[name], num_experts=4, top_k=2, capacity_factor=8.0)  # MoELayer blocks
    for layer in moe_layers(moe):
        layer.gate.weight.add_(torch.randn_like(layer.gate.weight))  # a router that prefers some experts
    moe.config.router_aux_loss_coef = moe.router_aux_loss_coef = 0.5  # the model reads its copy, made at init
    ours = moe(IDS, labels=IDS, output_router_logits=True)
    assert len(ours.router_logits) == 2 and ours.router_logits[0].shape == (IDS.numel(), 4)
    assert moe(IDS).router_logits is None  # collected only when asked for
    moe.save_pretrained(tmp_path)
    native = type(moe).from_pretrained(tmp_path).eval()
    assert not moe_layers(native)
    theirs = native(IDS, labels=IDS, output_router_logits=True)
    for got, want in zip(ours.router_logits, theirs.router_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=1e-5)


def test_blocks_are_transformers_own_unless_they_cannot_route_as_asked():
    """A capacity limit, and jitter on Qwen2-MoE (which has none), take `MoELayer` blocks; the rest keep
    transformers' blocks computing through `experts_implementation="llmkit"` (Mixtral jitters natively)."""
    models = dense_models()
    jittered = upcycle_to_moe(models["llama"], num_experts=4, top_k=2, jitter_noise=0.1)
    assert not moe_layers(jittered) and jittered.config.router_jitter_noise == 0.1
    assert len(moe_layers(upcycle_to_moe(models["qwen2"], num_experts=4, top_k=2, jitter_noise=0.1))) == 2
    assert not moe_layers(upcycle_to_moe(dense_models()["qwen2"], num_experts=4, top_k=2))
    capped = upcycle_to_moe(tiny_llama(), num_experts=4, top_k=2, capacity_factor=1.0)
    assert [layer.capacity_factor for layer in moe_layers(capped)] == [1.0, 1.0]
