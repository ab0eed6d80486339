"""Shared by the callback tests: a deterministic token dataset and short CPU Trainer runs."""

from __future__ import annotations

import os
from typing import Any

import torch

from hf_llmkit.testing import tiny_llama

VOCAB = 128
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1)


class Blocks(torch.utils.data.Dataset):
    """`n` fixed token blocks; block `poison` (if any) starts with token id 3, which tests use to inject failures."""

    def __init__(self, n: int = 32, length: int = 8, poison: tuple[int, ...] = ()):
        generator = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(4, VOCAB, (n, length), generator=generator)
        for index in poison:
            self.ids[index, 0] = 3

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def small_model(seed: int = 0):
    return tiny_llama(seed=seed, **SMALL).train()


def make_trainer(
    output_dir: str | os.PathLike,
    *,
    model=None,
    callbacks=(),
    data=None,
    eval_data=None,
    plain: bool = False,
    **overrides: Any,
):
    """An `LLMKitTrainer` (or a plain `Trainer`) on CPU for a few steps, no reporting."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from hf_llmkit import LLMKitTrainingArguments
    from hf_llmkit.trainers import LLMKitTrainer

    kwargs = dict(
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        save_steps=2,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        save_retry_delay=0.01,
    )
    kwargs.update(overrides)
    if plain:
        for key in ("save_retry_delay", "save_retries", "auto_resume", "resume_verify_checksums"):
            kwargs.pop(key, None)
    args = (TrainingArguments if plain else LLMKitTrainingArguments)(output_dir=str(output_dir), **kwargs)
    cls = Trainer if plain else LLMKitTrainer
    return cls(
        model=model if model is not None else small_model(),
        args=args,
        train_dataset=data if data is not None else Blocks(),
        eval_dataset=eval_data,
        data_collator=default_data_collator,
        callbacks=list(callbacks),
    )


def poison_loss(model, factor: float = float("nan")):
    """Multiply the loss of every training batch holding a block that starts with token 3 by `factor`."""

    def hook(module, args, kwargs, output):
        ids = kwargs.get("input_ids")
        if module.training and ids is not None and bool((ids[:, 0] == 3).any()):
            output["loss"] = output["loss"] * factor
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


def record_blocks(model, data: Blocks) -> tuple[list[tuple[int, ...]], Any]:
    """Record which blocks each training forward sees (a list filled in as training runs) and the hook handle."""
    index = {tuple(row.tolist()): i for i, row in enumerate(data.ids)}
    seen: list[tuple[int, ...]] = []

    def hook(module, args, kwargs, output):
        ids = kwargs.get("input_ids")
        if module.training and ids is not None:
            seen.append(tuple(sorted(index[tuple(row.tolist())] for row in ids)))

    return seen, model.register_forward_hook(hook, with_kwargs=True)


def data_order(tmp_path, steps: int = 8) -> list[tuple[int, ...]]:
    """The blocks of each step of an uninterrupted run (same seed, sampler and batch size as `make_trainer`)."""
    model, data = small_model(), Blocks()
    seen, _ = record_blocks(model, data)
    make_trainer(tmp_path / "order", model=model, data=data, max_steps=steps, save_strategy="no").train()
    return seen
