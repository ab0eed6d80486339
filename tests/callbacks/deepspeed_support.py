"""DeepSpeed runs for the callback tests, in fresh interpreters (`hf_llmkit.testing.launch`, one CPU rank)."""

from __future__ import annotations


def deepspeed_fp16_loss_scale(out_dir: str, stage: int) -> dict:
    """Train 6 steps with DeepSpeed fp16 (initial scale 2**8) and inf gradients on steps 2-3; return the logs."""
    import torch
    from transformers import Trainer, default_data_collator

    from hf_llmkit import LLMKitTrainingArguments
    from hf_llmkit.callbacks import LossScaleCallback
    from tests.callbacks.support import Blocks, small_model

    model = small_model()
    weight = model.model.embed_tokens.weight
    calls = {"n": 0}

    def hook(grad):
        calls["n"] += 1
        return torch.full_like(grad, float("inf")) if calls["n"] in (2, 3) else grad

    weight.register_hook(hook)
    deepspeed = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "min_loss_scale": 1},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    args = LLMKitTrainingArguments(
        out_dir,
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        logging_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        fp16=True,
        deepspeed=deepspeed,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Blocks(32),
        data_collator=default_data_collator,
        callbacks=[LossScaleCallback()],
    )
    trainer.train()
    return {
        "logs": [e for e in trainer.state.log_history if "loss" in e],
        "engine_skipped": trainer.model_wrapped.skipped_steps,
    }
