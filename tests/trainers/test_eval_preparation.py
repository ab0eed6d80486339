"""evaluate() before train() on 2 gloo ranks: training must still be data-parallel (identical replicas)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from datasets import Dataset

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.testing import tiny_llama
from hf_llmkit.trainers import LLMKitTrainer
from tests.warm import launch


def _evaluate_then_train() -> float:
    """Returns the largest parameter difference between this rank and rank 0 after training."""
    torch.manual_seed(0)
    ids = torch.randint(3, 512, (16, 16))
    rank_data = ids[
        int(os.environ["RANK"]) :: 2
    ]  # different samples per rank: replicas only agree if grads are reduced
    data = Dataset.from_dict({"input_ids": rank_data.tolist(), "labels": rank_data.tolist()})
    with tempfile.TemporaryDirectory() as out:
        args = LLMKitTrainingArguments(
            output_dir=out, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, report_to="none",
            save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False,
        )  # fmt: skip
        trainer = LLMKitTrainer(model=tiny_llama(seed=0), args=args, train_dataset=data, eval_dataset=data)
        trainer.evaluate()
        trainer.train()
    flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    return (flat - reference).abs().max().item()


@pytest.mark.slow  # run_clm evaluates before training on 2 ranks in tests/examples/test_run_clm.py (make test)
def test_evaluate_before_train_keeps_replicas_identical():
    differences = launch(_evaluate_then_train, nprocs=2, timeout=240, init_process_group=False)
    assert differences == [0.0, 0.0]
