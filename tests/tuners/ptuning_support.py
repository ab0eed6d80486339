"""Shared by test_ptuning.py and test_ptuning_v2.py: data, short Trainer runs, fresh-process reloads, 4-bit and ZeRO-3.

Functions run in a fresh interpreter through `hf_llmkit.testing.launch`, so they live at module top level.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import hf_llmkit
from hf_llmkit.testing import launch, tiny_llama

REPO = Path(__file__).resolve().parents[2]
VOCAB = 512  # tiny_llama's vocabulary: P-tuning v1 virtual ids start here


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
    """A CPU `Trainer` for a few steps (no reporting, no saving unless asked)."""
    from transformers import Trainer

    kwargs = dict(
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return Trainer(model=model, args=hf_llmkit.LLMKitTrainingArguments(str(out_dir), **kwargs), train_dataset=data)


def reload_logits(jobs: list[tuple[str, torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
    """Logits of `tiny_llama()` + each saved adapter (run in a fresh process by `fresh_logits`)."""
    from peft import PeftModel

    import hf_llmkit  # noqa: F401  (registers the methods in this fresh interpreter)

    out = []
    for adapter_dir, input_ids, attention_mask in jobs:
        model = PeftModel.from_pretrained(tiny_llama(), adapter_dir).eval()
        with torch.no_grad():
            out.append(model(input_ids=input_ids, attention_mask=attention_mask).logits)
    return out


def fresh_logits(jobs: list[tuple[str | os.PathLike, torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
    """`reload_logits` in one brand-new interpreter (nothing registered or cached from this process).

    Jobs are batched because importing the stack in a new interpreter costs seconds.
    """
    jobs = [(str(d), ids, mask) for d, ids, mask in jobs]
    env = {"PYTHONPATH": str(REPO)}
    return launch(reload_logits, jobs, nprocs=1, init_process_group=False, timeout=180, env=env)[0]


def quantized_tiny_llama(folder: str | os.PathLike, **overrides: Any):
    """The tiny Llama saved to `folder` and reloaded in bitsandbytes 4-bit NF4 (runs on CPU)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_llama(**overrides).save_pretrained(folder)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, device_map="cpu")


def zero3_train_and_save(out_dir: str) -> dict[str, dict]:
    """Train both P-tuning methods two steps under DeepSpeed ZeRO-3 (one CPU rank) and save them with the Trainer.

    Returns per method the saved tensors and the full (unpartitioned) shapes the adapter should have.
    """
    from peft import get_peft_model
    from safetensors.torch import load_file

    configs = {
        "ptuning": (hf_llmkit.PTuningConfig(num_virtual_tokens=3), 3),
        "ptuning_v2": (hf_llmkit.PTuningV2Config(num_virtual_tokens=3, prefix_projection=True), 0),
    }
    deepspeed = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        "zero_allow_untested_optimizer": True,
    }
    results = {}
    for method, (config, virtual) in configs.items():
        model = get_peft_model(tiny_llama(), config)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if ".ptuning" in k}
        folder = os.path.join(out_dir, method)
        run = trainer(model, examples(8, virtual=virtual), folder, max_steps=2, deepspeed=deepspeed, use_cpu=False)
        run.train()
        run.save_model(folder)
        saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
        results[method] = {"saved": saved, "shapes": shapes, "files": sorted(os.listdir(folder))}
    return results


def run_zero3(out_dir: str | os.PathLike) -> dict[str, dict]:
    return launch(zero3_train_and_save, str(out_dir), nprocs=1, timeout=300, env={"PYTHONPATH": str(REPO)})[0]
