"""Shared by the tuner tests: data, short Trainer runs, fresh-process reloads, a 4-bit base, and one ZeRO-3 run that
trains and saves every method.

Functions run in another process (`hf_llmkit.testing.launch`, tests/warm.py), so they live at module top level.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import hf_llmkit
from hf_llmkit.testing import tiny_llama, tiny_training_args
from tests import warm

REPO = Path(__file__).resolve().parents[2]
VOCAB = 512  # tiny_llama's vocabulary: P-tuning v1 virtual ids start here

# What each method trains in the shared Trainer / ZeRO-3 runs (adapters start as the identity where they can).
METHODS = {
    "houlsby": lambda: hf_llmkit.BottleneckConfig(bottleneck_size=8),
    "bitfit": lambda: hf_llmkit.BitFitConfig(add_missing_biases=True),
    "ptuning": lambda: hf_llmkit.PTuningConfig(num_virtual_tokens=3),
    "ptuning_v2": lambda: hf_llmkit.PTuningV2Config(num_virtual_tokens=3, prefix_projection=True),
}


def examples(n: int, *, length: int = 12, virtual: int = 0, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`n` causal-LM examples; the first `virtual` positions are the P-tuning virtual ids 512, 513, ..."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (length,), generator=g)
        ids[:virtual] = torch.arange(VOCAB, VOCAB + virtual)
        rows.append({"input_ids": ids, "labels": ids.masked_fill(ids >= VOCAB, -100)})
    return rows


def trainer(model: Any, data: list[dict], out_dir: str | os.PathLike, **overrides: Any):
    """A `Trainer` over `data` with `tiny_training_args(out_dir, **overrides)`."""
    from transformers import Trainer

    return Trainer(model=model, args=tiny_training_args(out_dir, **overrides), train_dataset=data)


def snapshot(model: torch.nn.Module, marker: str) -> dict[str, torch.Tensor]:
    """Copies of the parameters whose name contains `marker` (e.g. an adapter attribute)."""
    return {k: v.detach().clone() for k, v in model.named_parameters() if marker in k}


def reload_logits(jobs: list[tuple[str, torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
    """Logits of `tiny_llama()` + each saved adapter (run in another process by `fresh_logits`)."""
    from peft import PeftModel

    out = []
    for adapter_dir, input_ids, attention_mask in jobs:
        model = PeftModel.from_pretrained(tiny_llama(), adapter_dir).eval()
        with torch.no_grad():
            out.append(model(input_ids=input_ids, attention_mask=attention_mask).logits)
    return out


def fresh_logits(jobs: list[tuple[str | os.PathLike, torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
    """`reload_logits` in another process, freshly imported and holding nothing of this one: a child of the warm
    interpreter (tests/warm.py), which imports the stack once per test process."""
    jobs = [(str(d), ids, mask) for d, ids, mask in jobs]
    return warm.call(reload_logits, jobs, timeout=180)


def quantized_tiny_llama(folder: str | os.PathLike, **overrides: Any):
    """The tiny Llama saved to `folder` and reloaded in bitsandbytes 4-bit NF4 (runs on CPU)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_llama(**overrides).save_pretrained(folder)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, device_map="cpu")


def zero3_train_and_save(model_dir: str, out_dir: str) -> dict[str, dict]:
    """One DeepSpeed ZeRO-3 rank: per method, load the base partitioned (zero.Init), add the adapter, train two steps
    and save with the Trainer. Returns per method whether the base was partitioned, the saved tensors and files."""
    from peft import get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Trainer

    deepspeed = {
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_allow_untested_optimizer": True,
    }
    results = {}
    for name, make_config in METHODS.items():
        folder = os.path.join(out_dir, name)
        args = tiny_training_args(folder, max_steps=2, deepspeed=deepspeed, use_cpu=False)
        model = AutoModelForCausalLM.from_pretrained(model_dir)  # partitioned: the arguments came first
        partitioned = hasattr(model.model.layers[0].mlp.down_proj.weight, "ds_shape")
        data = examples(8, virtual=3 if name == "ptuning" else 0)
        run = Trainer(model=get_peft_model(model, make_config()), args=args, train_dataset=data)
        run.train()
        run.save_model(folder)
        saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
        results[name] = {"partitioned": partitioned, "saved": saved, "files": sorted(os.listdir(folder))}
    return results


def run_zero3(tmp: Path) -> dict[str, dict]:
    tiny_llama().save_pretrained(tmp / "base")
    env = {"PYTHONPATH": str(REPO), "ACCELERATE_USE_DEEPSPEED": "true"}
    return warm.launch(
        zero3_train_and_save, str(tmp / "base"), str(tmp / "out"), nprocs=1, timeout=300, init_process_group=False,
        env=env,
    )[0]  # fmt: skip
