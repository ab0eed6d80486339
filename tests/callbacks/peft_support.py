"""Functions for SavePeftModelCallback tests that run in processes of their own (children of tests/warm.py)."""

from __future__ import annotations

import os

import torch

from tests.callbacks.support import SMALL, Blocks


def reload_logits(base_seed: int, adapter_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of the base tiny Llama + the saved adapter, in a process that never saw the training run."""
    from peft import PeftModel

    import hf_llmkit  # noqa: F401  (registers hf_llmkit's PEFT methods here)
    from hf_llmkit.testing import tiny_llama

    model = PeftModel.from_pretrained(tiny_llama(seed=base_seed, **SMALL), adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def zero3_lora_run(out_dir: str) -> dict:
    """Train LoRA 2 steps under DeepSpeed ZeRO-3 (one CPU rank) with SavePeftModelCallback; report what was saved."""
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open
    from transformers import Trainer, default_data_collator

    from hf_llmkit import LLMKitTrainingArguments
    from hf_llmkit.callbacks import SavePeftModelCallback
    from hf_llmkit.testing import tiny_llama

    model = get_peft_model(tiny_llama(seed=0, **SMALL), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if "lora_" in k}
    deepspeed = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    args = LLMKitTrainingArguments(
        out_dir,
        max_steps=2,
        save_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        deepspeed=deepspeed,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Blocks(8),
        data_collator=default_data_collator,
        callbacks=[SavePeftModelCallback()],
    )
    trainer.train()
    partitioned = all(hasattr(p, "ds_id") for p in model.parameters())

    def shapes(path):
        with safe_open(path, framework="pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118

    checkpoint = os.path.join(out_dir, "checkpoint-2")
    return {
        "partitioned": partitioned,
        "expected": expected,
        "ours": shapes(os.path.join(checkpoint, "adapter", "adapter_model.safetensors")),
        "final": shapes(os.path.join(out_dir, "adapter", "adapter_model.safetensors")),
        "trainer_native": shapes(os.path.join(checkpoint, "adapter_model.safetensors")),
    }
