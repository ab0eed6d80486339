"""The peft workflows a user runs with BottleneckConfig / BitFitConfig: reload in a fresh process, the HF
Trainer (with gradient checkpointing), a bitsandbytes 4-bit nf4 base, and DeepSpeed ZeRO-3 saving."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file

from hf_llmkit import BitFitConfig, BottleneckConfig
from hf_llmkit.testing import launch, tiny_llama

CONFIGS = {
    "houlsby": lambda: BottleneckConfig(bottleneck_size=8, init_weights=False),
    "parallel": lambda: BottleneckConfig(placement="parallel", reduction_factor=4, init_weights=False),
    "bitfit": lambda: BitFitConfig(add_missing_biases=True, init_weights=False),
}

_RELOAD_SCRIPT = """
import sys, torch
import hf_llmkit
from peft import PeftModel
from hf_llmkit.testing import tiny_llama
root = sys.argv[1]
inputs = torch.load(f"{root}/inputs.pt")
for name in sys.argv[2:]:
    model = PeftModel.from_pretrained(tiny_llama(), f"{root}/{name}")
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    assert torch.equal(logits, torch.load(f"{root}/{name}.pt")), name
    trainable = PeftModel.from_pretrained(tiny_llama(), f"{root}/{name}", is_trainable=True)
    assert trainable.get_nb_trainable_parameters()[0] == model.get_nb_trainable_parameters()[1] - sum(
        p.numel() for p in tiny_llama().parameters()), name
    print("OK", name)
"""


def test_fresh_process_reload_gives_identical_logits(tmp_path):
    inputs = torch.randint(3, 500, (2, 12))
    torch.save(inputs, tmp_path / "inputs.pt")
    for name, make_config in CONFIGS.items():
        model = get_peft_model(tiny_llama(), make_config())
        with torch.no_grad():
            torch.save(model(input_ids=inputs).logits, tmp_path / f"{name}.pt")
        model.save_pretrained(tmp_path / name)
    cmd = [sys.executable, "-c", textwrap.dedent(_RELOAD_SCRIPT), str(tmp_path), *CONFIGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == [w for name in CONFIGS for w in ("OK", name)]


def _lm_rows(n: int = 16, length: int = 16) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(3, 500, (n, length), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


@pytest.mark.parametrize("name", ["houlsby", "bitfit"])
def test_trainer_trains_with_gradient_checkpointing_and_saves_only_the_adapter(name, tmp_path):
    from transformers import Trainer, TrainingArguments

    config = CONFIGS[name]()
    config.init_weights = True
    model = get_peft_model(tiny_llama(), config)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    args = TrainingArguments(
        str(tmp_path / "run"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        activation_checkpointing=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_lm_rows())
    result = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses))) and result.global_step == 4
    assert all(torch.equal(base_before[n], p) for n, p in model.named_parameters() if n in base_before)
    trainer.save_model(str(tmp_path / "adapter"))
    state = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert all(".bottleneck_" in k or ".bitfit_" in k for k in state)
    moved = [k for k, v in state.items() if ("bottleneck_up" in k or "bitfit_bias" in k) and v.abs().sum() > 0]
    assert moved, "training left the zero-initialised adapter weights at zero"
    assert not (tmp_path / "adapter" / "model.safetensors").exists()


@pytest.fixture(scope="module")
def nf4_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama().save_pretrained(folder)
    return folder


def _load_nf4(folder):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_4bit_nf4_base(name, nf4_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    model = _load_nf4(nf4_dir)
    assert isinstance(model.model.layers[0].mlp.down_proj, bnb.nn.Linear4bit)
    inputs = torch.randint(3, 500, (2, 8))
    with torch.no_grad():
        base = model(input_ids=inputs).logits
    config = CONFIGS[name]()
    config.init_weights = True
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=inputs).logits, base, rtol=0, atol=0)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        loss = peft_model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        trained = peft_model(input_ids=inputs).logits
    assert not torch.allclose(trained, base)
    peft_model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(_load_nf4(nf4_dir), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=inputs).logits, trained, rtol=0, atol=0)
        if name == "bitfit":  # the biases fold into the 4-bit layers exactly: only the float bias changes
            merged = reloaded.merge_and_unload()
            assert isinstance(merged.model.layers[0].mlp.down_proj, bnb.nn.Linear4bit)
            torch.testing.assert_close(merged(input_ids=inputs).logits, trained, rtol=1e-6, atol=1e-6)


def zero3_train_and_save(model_dir: str, out_dir: str) -> dict[str, dict[str, tuple]]:
    """One DeepSpeed ZeRO-3 rank: load the base partitioned (zero.Init), add each adapter, train, save."""
    from transformers import AutoModelForCausalLM, Trainer

    from hf_llmkit import LLMKitTrainingArguments

    ds_config = {
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_allow_untested_optimizer": True,
    }
    report = {}
    for name in ("houlsby", "bitfit"):
        args = LLMKitTrainingArguments(
            f"{out_dir}/{name}",
            deepspeed=ds_config,
            max_steps=2,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir)  # partitioned: TrainingArguments came first
        partitioned = hasattr(model.model.layers[0].mlp.down_proj.weight, "ds_shape")
        config = CONFIGS[name]()
        config.init_weights = True
        trainer = Trainer(model=get_peft_model(model, config), args=args, train_dataset=_lm_rows())
        trainer.train()
        trainer.save_model(f"{out_dir}/{name}/adapter")
        state = load_file(f"{out_dir}/{name}/adapter/adapter_model.safetensors")
        report[name] = {
            "partitioned": partitioned,
            "shapes": {k: tuple(v.shape) for k, v in state.items()},
            "moved": any(v.abs().sum() > 0 for k, v in state.items() if "bottleneck_up" in k or "bitfit_bias" in k),
        }
    return report


def test_deepspeed_zero3_saves_complete_adapter_weights(tmp_path):
    pytest.importorskip("deepspeed")
    tiny_llama().save_pretrained(tmp_path / "base")
    (report,) = launch(
        zero3_train_and_save,
        str(tmp_path / "base"),
        str(tmp_path / "out"),
        nprocs=1,
        timeout=240,
        init_process_group=False,
        env={"ACCELERATE_USE_DEEPSPEED": "true"},
    )
    for name in ("houlsby", "bitfit"):
        reference = get_peft_model(tiny_llama(), CONFIGS[name]())
        expected = {
            k.replace(".default", ""): tuple(p.shape) for k, p in reference.named_parameters() if p.requires_grad
        }
        assert report[name]["partitioned"], "the base model was not partitioned: the test would prove nothing"
        assert report[name]["shapes"] == expected  # complete, non-empty tensors (no 0-sized ZeRO-3 shards)
        assert report[name]["moved"]
