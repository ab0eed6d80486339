"""Loading a DKM checkpoint never silently yields a different model: an edited or damaged checkpoint is a ValueError
naming the tensor or module, raised before any weight is used."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import (
    DKMLinear,
    PalettizedEmbedding,
    PalettizedLinear,
    keep_training_state,
    quantize_model,
)
from hf_llmkit.testing import tiny_llama, tiny_model

Q = "model.layers.0.self_attn.q_proj"
SCALED = DKMConfig(bits=4, scale_block_size=16, lut_dtype="float16")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Compact checkpoints (lm_head kept dense / lm_head clustered) and a training-state one."""
    root = tmp_path_factory.mktemp("dkm_checkpoints")
    out = {}
    for name, config in (("compact", DKMConfig(bits=3)), ("lm_head", DKMConfig(bits=3, modules_to_not_convert=[]))):
        quantize_model(tiny_llama(), config).save_pretrained(root / name)
        out[name] = root / name
    for name, config in (("training", DKMConfig(bits=3)), ("scaled", SCALED)):
        model = quantize_model(tiny_llama(), config)
        keep_training_state(model)
        model.save_pretrained(root / name)
        out[name] = root / name
    quantize_model(tiny_llama(), SCALED).save_pretrained(root / "scaled_compact")
    out["scaled_compact"] = root / "scaled_compact"
    return out


def _edit(src: Path, dst: Path, tensors=None, config=None) -> Path:
    """Copy a checkpoint folder, changing its tensors (`tensors(dict)`) and/or its quantization_config."""
    shutil.copytree(src, dst)
    if tensors is not None:
        state = load_file(dst / "model.safetensors")
        tensors(state)
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_deleted_lookup_table(saved, tmp_path):
    bad = _edit(saved["compact"], tmp_path / "bad", tensors=lambda s: s.pop(f"{Q}.weight_lut"))
    with pytest.raises(ValueError, match=rf"no '{Q}\.weight_lut'.*incomplete"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_deleted_packed_indices_of_a_whole_layer(saved, tmp_path):
    def drop(state):
        del state[f"{Q}.weight_lut"], state[f"{Q}.weight_packed"]

    with pytest.raises(ValueError, match=rf"no tensors for '{Q}'"):
        AutoModelForCausalLM.from_pretrained(_edit(saved["compact"], tmp_path / "bad", tensors=drop))


def test_nan_lookup_table(saved, tmp_path):
    def poison(state):
        state[f"{Q}.weight_lut"][0, 3, 0] = float("nan")

    bad = _edit(saved["compact"], tmp_path / "bad", tensors=poison)
    with pytest.raises(ValueError, match=rf"'{Q}\.weight_lut' holds NaN/Inf"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_nan_centroids_of_a_training_checkpoint(saved, tmp_path):
    def poison(state):
        state[f"{Q}.centroids"][0, 0, 0] = float("inf")

    bad = _edit(saved["training"], tmp_path / "bad", tensors=poison)
    with pytest.raises(ValueError, match=rf"'{Q}\.centroids' holds NaN/Inf"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_non_zero_padding_bits(tmp_path):
    """511 embedding vectors of 64 values at 3 bits: 1,533 index bits in 192 bytes, 3 padding bits."""
    config = DKMConfig(bits=3, cluster_dim=64, quantize_embeddings=True, embedding_bits=3)
    good = tmp_path / "good"
    quantize_model(tiny_llama(vocab_size=511), config).save_pretrained(good)
    assert isinstance(AutoModelForCausalLM.from_pretrained(good).model.embed_tokens, PalettizedEmbedding)

    def flip(state):
        state["model.embed_tokens.weight_packed"][-1] |= 0x80

    bad = _edit(good, tmp_path / "bad", tensors=flip)
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight_packed' has non-zero padding bits"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_modules_to_not_convert_edited_to_keep_a_clustered_lm_head(saved, tmp_path):
    bad = _edit(saved["lm_head"], tmp_path / "bad", config=lambda q: q.update(modules_to_not_convert=["lm_head"]))
    with pytest.raises(ValueError, match=r"DKM tensors for 'lm_head'.*freshly initialised.*modules_to_not_convert"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_modules_to_not_convert_edited_to_cluster_a_dense_lm_head(saved, tmp_path):
    bad = _edit(saved["compact"], tmp_path / "bad", config=lambda q: q.update(modules_to_not_convert=[]))
    with pytest.raises(ValueError, match=r"stores 'lm_head' in full precision.*modules_to_not_convert"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_untouched_checkpoints_load(saved):
    for name in ("compact", "lm_head"):
        model = AutoModelForCausalLM.from_pretrained(saved[name])
        assert type(model.get_submodule(Q)).__name__ == "PalettizedLinear"
    assert isinstance(AutoModelForCausalLM.from_pretrained(saved["training"]).get_submodule(Q), DKMLinear)


def test_load_state_dict_into_a_trainable_layer_checks_the_table(saved):
    state = load_file(saved["compact"] / "model.safetensors")
    model = quantize_model(tiny_llama(), DKMConfig(bits=3))
    missing_lut = {k: v for k, v in state.items() if k != f"{Q}.weight_lut"}
    with pytest.raises(ValueError, match=rf"no '{Q}\.weight_lut'"):
        model.load_state_dict(missing_lut, strict=False)
    state[f"{Q}.weight_lut"] = state[f"{Q}.weight_lut"] * float("nan")
    with pytest.raises(ValueError, match=rf"'{Q}\.weight_lut' holds NaN/Inf"):
        model.load_state_dict(state, strict=False)
    wrong = dict(state, **{f"{Q}.weight_lut": torch.zeros(1, 4, 1)})
    with pytest.raises(ValueError, match=r"has shape \(1, 4, 1\), expected \(1, 8, 1\)"):
        model.load_state_dict(wrong, strict=False)


def test_tables_saved_in_another_dtype_than_the_config_says_are_refused(saved, tmp_path):
    """A config.json edited to `lut_dtype="float16"` over float32 tables would round them on load."""
    bad = _edit(saved["compact"], tmp_path / "bad", config=lambda q: q.update(lut_dtype="float16"))
    with pytest.raises(ValueError, match=r"weight_lut' is saved as float32 but quantization_config.lut_dtype is "):
        AutoModelForCausalLM.from_pretrained(bad)


def test_block_scales_and_the_config_must_agree(saved, tmp_path):
    """Block scales (`scale_block_size`): a config.json edited to drop them, or one that asks for scales a checkpoint
    lacks, or damaged scales, are refused with the fix; untouched checkpoints load with their scales."""
    compact, training = saved["scaled_compact"], saved["scaled"]
    assert type(AutoModelForCausalLM.from_pretrained(compact).get_submodule(Q)).__name__ == "PalettizedLinear"
    layer = AutoModelForCausalLM.from_pretrained(training).get_submodule(Q)
    assert isinstance(layer, DKMLinear) and torch.equal(
        layer.scales, load_file(training / "model.safetensors")[f"{Q}.scales"]
    )
    cases = {
        "unscaled_config": (compact, None, lambda q: q.update(scale_block_size=0), "set scale_block_size in config"),
        "no_scale": (compact, lambda s: s.pop(f"{Q}.weight_scale"), None, rf"no '{Q}\.weight_scale' but its"),
        "scales_asked": (saved["compact"], None, lambda q: q.update(scale_block_size=16), "weight_scale' but its"),
        "zero": (compact, lambda s: s[f"{Q}.weight_scale"].zero_(), None, rf"'{Q}\.weight_scale' holds scales <= 0"),
        "nan": (compact, lambda s: s[f"{Q}.weight_scale"].fill_(float("nan")), None, "weight_scale' holds NaN/Inf"),
        "dtype": (
            compact,
            lambda s: s.update({f"{Q}.weight_scale": s[f"{Q}.weight_scale"].float()}),
            None,
            r"weight_scale' is saved as float32 but quantization_config.lut_dtype is 'float16'",
        ),
    }
    for name, (src, tensors, config, match) in cases.items():
        bad = _edit(src, tmp_path / name, tensors=tensors, config=config)
        with pytest.raises(ValueError, match=match):
            AutoModelForCausalLM.from_pretrained(bad)
    foreign = _edit(
        saved["compact"], tmp_path / "foreign", tensors=lambda s: s.update({"lm_head.scales": torch.ones(2)})
    )
    AutoModelForCausalLM.from_pretrained(foreign)  # a tensor named so in a module DKM does not cluster is not ours
    foreign = _edit(
        compact, tmp_path / "foreign_fp32", tensors=lambda s: s.update({"lm_head.weight_scale": torch.ones(2)})
    )
    AutoModelForCausalLM.from_pretrained(foreign)  # nor is its dtype (float32 here, the tables float16)
    state = load_file(training / "model.safetensors")  # a Trainer resume loads the training state so
    del state[f"{Q}.scales"]
    with pytest.raises(ValueError, match=rf"no '{Q}\.scales' but its quantization_config sets scale_block_size"):
        quantize_model(tiny_llama(), SCALED).load_state_dict(state, strict=False)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64])
def test_a_table_in_no_lookup_table_dtype_says_the_checkpoint_is_not_ours(saved, tmp_path, dtype):
    """Issue 46: an int32 / float64 table got the advice to set lut_dtype to 'I32' / 'F64' (no valid value)."""
    bad = _edit(
        saved["compact"],
        tmp_path / "bad",
        tensors=lambda s: s.update({f"{Q}.weight_lut": s[f"{Q}.weight_lut"].to(dtype)}),
    )
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(
        ValueError, match=rf"weight_lut' is saved as {name}, which is no lookup-table dtype \(float32, "
    ) as e:
        AutoModelForCausalLM.from_pretrained(bad)
    assert "save it again from the trained model" in str(e.value) and "'I32'" not in str(e.value)


@pytest.mark.parametrize("what", ["table", "latent weight"])
def test_a_model_with_a_nan_table_is_refused_before_its_folder_is_made(tmp_path, what):
    """Issue 46: save_pretrained said `index 8 is out of bounds` and left an empty folder (a NaN latent weight saved
    an arbitrary index without a word)."""
    model = quantize_model(tiny_llama(), DKMConfig(bits=3))
    layer = model.get_submodule(Q)
    with torch.no_grad():
        (layer.centroids if what == "table" else layer.weight)[0, 2] = float("nan")
    with pytest.raises(ValueError, match=rf"^Cannot save the DKM model: the {what} of '{Q}' holds NaN or infinity"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_dtype_cast_keeps_the_tables_as_loading_in_that_dtype_does(saved, tmp_path):
    """Issue 46: `.to(torch.float16)` rounded the tables (the in-memory model changed and its save no longer matched
    its config, refused on reload), where `from_pretrained(..., dtype=torch.float16)` keeps them; `.half()` is
    transformers' refusal for every quantized model."""
    cast = AutoModelForCausalLM.from_pretrained(saved["scaled_compact"]).to(torch.float16)
    loaded = AutoModelForCausalLM.from_pretrained(saved["scaled_compact"], dtype=torch.float16)
    ours, theirs = cast.state_dict(), loaded.state_dict()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in theirs)
    assert cast.get_submodule(Q).weight_lut.dtype == torch.float16 == cast.get_submodule(Q).weight_scale.dtype
    cast.save_pretrained(tmp_path / "cast")
    AutoModelForCausalLM.from_pretrained(tmp_path / "cast")  # its tables still match its config
    layer = quantize_model(tiny_llama(), SCALED).to(torch.bfloat16).get_submodule(Q)
    assert (layer.weight.dtype, layer.centroids.dtype, layer.scales.dtype) == (
        torch.bfloat16,
        torch.float32,
        torch.float32,
    )
    compact = AutoModelForCausalLM.from_pretrained(saved["compact"]).to(torch.bfloat16)
    assert compact.get_submodule(Q).weight_lut.dtype == torch.float32  # lut_dtype float32
    with pytest.raises(ValueError, match="not supported for quantized model"):
        compact.half()


def test_biases_a_checkpoint_lacks_are_initialised_as_transformers_does(saved, tmp_path):
    """A packed layer's bias that the checkpoint does not hold (the config asks for biases, or another architecture's
    class loads it) is zero, as transformers makes a plain checkpoint's missing Linear bias, never uninitialised
    memory; biases the checkpoint holds load as saved."""
    ids = torch.tensor([[1, 5, 9, 22, 7, 3]])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(saved["compact"])(ids).logits
        with_bias = AutoModelForCausalLM.from_pretrained(saved["compact"], attention_bias=True)
        qwen2 = Qwen2ForCausalLM.from_pretrained(saved["compact"])
        for model in (with_bias, qwen2):
            q_proj = model.model.layers[0].self_attn.q_proj
            assert isinstance(q_proj, PalettizedLinear) and torch.equal(q_proj.bias, torch.zeros_like(q_proj.bias))
        torch.testing.assert_close(with_bias(ids).logits, plain)
        assert torch.isfinite(qwen2(ids).logits).all()
        source = tiny_model("qwen2", num_hidden_layers=1)
        for module in source.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_()
        quantize_model(source, DKMConfig(bits=3)).save_pretrained(tmp_path / "qwen2")
        k_proj = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen2").model.layers[0].self_attn.k_proj
        assert torch.equal(k_proj.bias, source.model.layers[0].self_attn.k_proj.bias)
