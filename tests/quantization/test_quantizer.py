"""The "dkm" quantization method end to end: from_pretrained, Trainer QAT (alone and under PEFT), packed
save -> reload in a fresh process with identical logits, bad checkpoints, optimum's post-training path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_llmkit import DKMConfig
from hf_llmkit.data.corpus import corpus_texts
from hf_llmkit.quantization import DKMEmbedding, DKMLinear, DKMOptimumQuantizer, PalettizedLinear
from hf_llmkit.testing import tiny_llama
from tests import warm

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama().save_pretrained(path)
    return path


def _ids(batch: int = 2, length: int = 24, offset: int = 0) -> torch.Tensor:
    """Byte ids of real English text (the tiny model's vocabulary covers all bytes)."""
    text = " ".join(corpus_texts()[offset : offset + 50]).encode()
    return torch.tensor(list(text[: batch * length])).reshape(batch, length)


class _ByteDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 8):
        self.rows = _ids(n, 32, offset=100)

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _train(model, out_dir: Path, steps: int = 3, lr: float = 1e-3):
    args = TrainingArguments(
        output_dir=str(out_dir),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=lr,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_ByteDataset())
    return trainer.train()


def test_from_pretrained_swaps_targets_keeps_lm_head(base_dir):
    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=DKMConfig(bits=3))
    for layer in model.model.layers:
        for name in TARGETS:
            module = layer.get_submodule(
                f"self_attn.{name}" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else f"mlp.{name}"
            )
            assert isinstance(module, DKMLinear)
            assert module.dkm_initialised and module.centroids.shape == (1, 8, 1)
            assert module.centroids.flatten().unique().numel() == 8
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert model.is_quantized and model.hf_quantizer.quantization_config.bits == 3
    model.eval()
    q = model.model.layers[0].self_attn.q_proj
    assert q.hard_weight(torch.float32).unique().numel() <= 8


def test_embeddings_use_their_own_bit_width(base_dir):
    cfg = DKMConfig(
        bits=2, quantize_embeddings=True, embedding_bits=4, granularity="per_grouped_channel", group_size=16
    )
    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=cfg)
    emb = model.model.embed_tokens
    assert isinstance(emb, DKMEmbedding) and emb.centroids.shape == (512 // 16, 16, 1)
    assert model.model.layers[0].mlp.up_proj.centroids.shape == (128 // 16, 4, 1)


def test_cluster_dim_not_dividing_is_a_clear_error(base_dir):
    with pytest.raises(ValueError, match="cluster_dim=3 does not divide the input dimension 64"):
        AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=DKMConfig(cluster_dim=3))


RELOAD = """
import sys, torch, hf_llmkit
from transformers import AutoModelForCausalLM
from hf_llmkit.quantization import PalettizedLinear
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
q_proj = model.model.layers[0].self_attn.q_proj
assert isinstance(q_proj, PalettizedLinear), type(q_proj)
ids = torch.load(sys.argv[2])
with torch.no_grad():
    logits = model(ids).logits
gen = model.generate(ids[:, :6], max_new_tokens=5, do_sample=False)
torch.save({"logits": logits, "generated": gen}, sys.argv[3])
"""


@pytest.fixture(scope="module")
def trained(base_dir, tmp_path_factory):
    """A DKM model after a short Trainer QAT run, and its packed checkpoint."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=DKMConfig(bits=3, cluster_dim=2))
    q = model.model.layers[0].self_attn.q_proj
    before = (q.weight.detach().clone(), q.centroids.clone())
    result = _train(model, tmp_path_factory.mktemp("qat"), steps=3, lr=5e-3)
    out = tmp_path_factory.mktemp("dkm_ckpt")
    model.eval()
    model.save_pretrained(out)
    return model, before, result, out


def test_trainer_qat_updates_weights_and_tables(trained):
    model, (w0, c0), result, _ = trained
    q = model.model.layers[0].self_attn.q_proj
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(q.weight.detach(), w0)  # the latent weights train
    assert not torch.equal(q.centroids, c0)  # DKM's centroid updates are kept between steps


def test_checkpoint_is_packed_and_small(trained, base_dir):
    model, _, _, out = trained
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "dkm" and config["bits"] == 3 and config["cluster_dim"] == 2
    with safe_open(out / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        packed = f.get_tensor("model.layers.0.mlp.down_proj.weight_packed")
        lut = f.get_tensor("model.layers.0.mlp.down_proj.weight_lut")
        stand_in = f.get_tensor("model.layers.0.mlp.down_proj.weight")  # one byte, not the dense weight
    assert stand_in.shape == (1,) and "model.layers.0.mlp.down_proj.centroids" not in keys
    assert packed.dtype == torch.uint8 and packed.numel() == (64 * 128 // 2 * 3 + 7) // 8
    assert lut.shape == (1, 8, 2)
    # The 14 target matrices take 3 bits per 2 weights instead of 32 bits per weight.
    target_fp32 = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, DKMLinear))
    target_packed = sum((m.weight.numel() // 2 * 3 + 7) // 8 for m in model.modules() if isinstance(m, DKMLinear))
    saved = (out / "model.safetensors").stat().st_size
    original = (base_dir / "model.safetensors").stat().st_size
    assert original - saved > 0.9 * (target_fp32 - target_packed)


def test_reload_in_fresh_process_identical_logits_and_generate(trained, tmp_path):
    model, _, _, out = trained
    ids = _ids()
    torch.save(ids, tmp_path / "ids.pt")
    _reload_in_a_fresh_process(out, tmp_path / "ids.pt", tmp_path / "out.pt", tmp_path)
    got = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        expected = model(ids).logits
        expected_gen = model.generate(ids[:, :6], max_new_tokens=5, do_sample=False)
    assert torch.equal(got["logits"], expected)
    assert torch.equal(got["generated"], expected_gen) and got["generated"].shape == (2, 11)


def test_checkpoint_not_matching_its_config_is_a_clear_error(trained, tmp_path):
    _, _, _, out = trained
    bad = tmp_path / "bad_bits"
    shutil.copytree(out, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 4
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"does not match its quantization_config at 'model.layers.0.*bits=4"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_lora_over_dkm_base_trains_adapters_only(base_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=DKMConfig(bits=4))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    q = model.model.layers[0].self_attn.q_proj
    base = q.base_layer
    assert isinstance(base, DKMLinear) and not base.weight.requires_grad
    w0 = base.weight.detach().clone()
    result = _train(peft_model, tmp_path, steps=2, lr=1e-2)
    assert result.global_step == 2
    assert q.lora_B["default"].weight.abs().sum() > 0  # the adapters trained
    assert torch.equal(base.weight.detach(), w0)  # the clustered base did not


def test_our_bottleneck_adapters_over_dkm_base(base_dir, tmp_path):
    from peft import get_peft_model

    from hf_llmkit import BottleneckConfig

    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=DKMConfig(bits=4))
    peft_model = get_peft_model(model, BottleneckConfig(bottleneck_size=8))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("centroids" not in n for n in trainable)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    result = _train(peft_model, tmp_path, steps=2, lr=1e-2)
    assert result.global_step == 2
    assert any(not torch.equal(p.detach(), before[n]) for n, p in peft_model.named_parameters() if n in before)


def test_optimum_post_training_kmeans_only(base_dir, tmp_path):
    out = DKMOptimumQuantizer.from_pretrained(str(base_dir)).quantize(
        tmp_path / "ptq", quantization_config=DKMConfig(bits=4)
    )
    packed = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(packed.model.layers[1].mlp.down_proj, PalettizedLinear)
    reference = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=DKMConfig(bits=4)).eval()
    dense = tiny_llama().eval()
    ids = _ids()
    with torch.no_grad():
        got, want, full = packed(ids).logits, reference(ids).logits, dense(ids).logits
    assert torch.equal(got, want)  # k-means tables, hard assignment, no fine-tuning
    cos = torch.nn.functional.cosine_similarity(got.flatten(), full.flatten(), dim=0)
    assert cos > 0.9
    with pytest.raises(ValueError, match="file_prefix=None"):
        DKMOptimumQuantizer.from_pretrained(str(base_dir)).quantize(tmp_path / "x", file_prefix="m")


def test_quantize_model_built_from_config_saves_and_reloads(tmp_path):
    from hf_llmkit.quantization import quantize_model

    model = quantize_model(tiny_llama(), DKMConfig(bits=2))
    assert isinstance(model.model.layers[0].mlp.gate_proj, DKMLinear) and model.is_quantized
    assert model.model.layers[0].mlp.gate_proj.dkm_initialised
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model.eval()(ids).logits)


def test_trainer_resumes_from_a_compact_checkpoint_with_a_warning(base_dir, tmp_path, caplog):
    """Without DKMTrainingStateCallback the Trainer's checkpoints are compact (a warning says so); resuming from one
    still trains (the latent weights restart from the hard assignment) and says it will not match an uninterrupted
    run."""
    import logging

    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=DKMConfig(bits=3))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        save_steps=2,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_ByteDataset())
    with pytest.warns(UserWarning, match="would not resume bit for bit"):
        trainer.train()
    with safe_open(tmp_path / "checkpoint-2" / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        stand_in = f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape()
    assert "model.layers.0.self_attn.q_proj.weight_packed" in keys and stand_in == [1]  # no latent weight
    fresh = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=DKMConfig(bits=3))
    args.max_steps = 3
    with caplog.at_level(logging.WARNING):
        result = Trainer(model=fresh, args=args, train_dataset=_ByteDataset()).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-2")
        )
    assert result.global_step == 3
    assert "will not match an uninterrupted one bit for bit" in caplog.text


def _reload_in_a_fresh_process(out: Path, ids: Path, result: Path, tmp_path: Path, **env: str) -> None:
    """`python reload.py out ids result` (RELOAD) in a process of its own, forked from tests/warm.py's interpreter
    (the stack imported, no model or state of this process in it)."""
    (tmp_path / "reload.py").write_text(RELOAD)
    proc = warm.run_script(tmp_path / "reload.py", [out, ids, result], timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _assert_reloads_exactly(model, out: Path, tmp_path: Path) -> None:
    """A fresh process loading the checkpoint `out` computes bit for bit the logits `model` computes here."""
    ids = _ids()
    torch.save(ids, tmp_path / "ids.pt")
    # the decoded path: bit for bit the hard assignment (the fused LUT-GEMV agrees within rounding, test_lut_gemv.py)
    _reload_in_a_fresh_process(out, tmp_path / "ids.pt", tmp_path / "r.pt", tmp_path, HF_LLMKIT_DKM_KERNEL="eager")
    with torch.no_grad():
        expected = model(ids).logits
    assert torch.equal(torch.load(tmp_path / "r.pt")["logits"], expected)


def test_a_16_bit_table_per_channel_trains_saves_small_and_reloads_exactly(base_dir, tmp_path):
    """`lut_dtype="float16"` with a table per output channel: the Trainer trains it, the checkpoint stores float16
    tables, and a fresh process computes bit for bit the logits of the trained model (whose hard assignment uses
    the rounded table)."""
    config = DKMConfig(bits=3, granularity="per_grouped_channel", group_size=1, lut_dtype="float16")
    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=config)
    q = model.model.layers[0].self_attn.q_proj
    assert q.centroids.shape == (q.out_features, 8, 1)
    _train(model, tmp_path / "qat", steps=2, lr=5e-3)
    out = tmp_path / "ckpt"
    model.eval()
    model.save_pretrained(out)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        lut = f.get_tensor("model.layers.0.self_attn.q_proj.weight_lut")
    assert lut.dtype == torch.float16 and lut.shape == (q.out_features, 8, 1)
    assert torch.equal(q.hard_weight(torch.float32).unique(), q.hard_weight(torch.float32).half().float().unique())
    _assert_reloads_exactly(model, out, tmp_path)
    with pytest.raises(ValueError, match=r"lut_dtype must be one of \('float32', 'float16', 'bfloat16'\)"):
        DKMConfig(lut_dtype="fp8")


def test_block_scales_train_save_small_and_reload_exactly(base_dir, tmp_path):
    """`scale_block_size=16` with 16-bit tables: the Trainer trains the latent weights, the checkpoint stores one
    float16 scale per 16 input features next to the packed indices and the table, and a fresh process computes bit
    for bit the logits of the trained model."""
    config = DKMConfig(bits=4, scale_block_size=16, lut_dtype="float16")
    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=config)
    down = model.model.layers[0].mlp.down_proj
    assert down.scales.shape == (64, 128 // 16) and down.centroids.shape == (1, 16, 1)
    w0, s0 = down.weight.detach().clone(), down.scales.clone()
    _train(model, tmp_path / "qat", steps=2, lr=5e-3)
    assert not torch.equal(down.weight.detach(), w0) and not torch.equal(down.scales, s0)  # scales follow the weights
    out = tmp_path / "ckpt"
    model.eval()
    model.save_pretrained(out)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
    assert scale.dtype == torch.float16 and scale.shape == (64, 8)
    assert not any(k.endswith((".scales", ".centroids", ".weight_packed.weight")) for k in keys)
    _assert_reloads_exactly(model, out, tmp_path)


def test_a_checkpoint_loaded_without_hf_llmkit_fails_instead_of_initialising_fresh_weights(trained, tmp_path):
    """transformers skips an unknown quantization method with a warning: without the one-byte stand-in `weight`s it
    would load the packed layers as freshly initialised Linear layers and return a model that runs. Its load report
    lists the checkpoint's one-byte marker, named after the fix (issue 46: nothing said to import hf_llmkit)."""
    _, _, _, out = trained
    script = f"from transformers import AutoModelForCausalLM\nAutoModelForCausalLM.from_pretrained({str(out)!r})\n"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0 and "size mismatch" in done.stdout + done.stderr, done.stderr[-2000:]
    assert "import_hf_llmkit_to_load_this_dkm_checkpoint" in done.stdout + done.stderr
