"""Sequence parallelism inside `LLMKitTrainer`: what `LLMKitTrainingArguments(sequence_parallel_size=P)` switches on.

- process groups: world = dp x sp, SP groups of consecutive ranks (`new_sequence_parallel_groups`);
- model: attention wrapped by `apply_sequence_parallel` (the model's sdpa / eager / flash stays the inner kernel);
- data: the data-parallel sampler uses the DP rank and size, so the ranks of one SP group load the same samples,
  and the collator keeps each rank's sequence shard (`SequenceParallelCollator`, labels shifted before the split);
- loss: the token-weighted mean over the SP group (`sequence_parallel_loss`), scaled so that the DDP / DeepSpeed
  gradient average over all ranks equals single-rank training on the same global batch (also with gradient
  accumulation and `average_tokens_across_devices`). Logged and evaluation losses are the full-sequence losses.

Evaluation returns each rank's logits for its own shard ([B, S/P, V]); `compute_metrics` that need full-sequence
logits are not supported. With several data-parallel groups, the last, uneven evaluation batch is truncated by
accelerate's `gather_for_metrics` as if every rank held different samples.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard
from torch.utils.data import DataLoader

from hf_llmkit.parallel.dims import ParallelDims
from hf_llmkit.parallel.groups import SequenceParallelGroups, new_sequence_parallel_groups
from hf_llmkit.parallel.host_clashes import check_sequence_parallel_config
from hf_llmkit.parallel.sequence.data import SequenceParallelCollator
from hf_llmkit.parallel.sequence.loss import sequence_parallel_loss, sequence_parallel_mean
from hf_llmkit.parallel.sequence.ulysses import apply_sequence_parallel


class TrainerSequenceParallel:
    """The sequence-parallel state of one trainer; `LLMKitTrainer` dispatches its data and loss hooks here."""

    def __init__(self, trainer: Any, groups: SequenceParallelGroups):
        self.groups = groups
        apply_sequence_parallel(trainer.model, group=groups.sp_group)
        trainer.data_collator = SequenceParallelCollator(
            trainer.data_collator, sp_rank=groups.sp_rank, sp_size=groups.sp_size, pad_token_id=_pad_id(trainer)
        )

    @classmethod
    def for_trainer(cls, trainer: Any) -> TrainerSequenceParallel | None:
        """Set up sequence parallelism when `trainer.args.sequence_parallel_size > 1`, else return None."""
        size = getattr(trainer.args, "sequence_parallel_size", 1)
        if size <= 1:
            return None
        config = getattr(trainer.accelerator, "parallelism_config", None)  # the launcher's route included
        check_sequence_parallel_config(size, config, source="the Accelerator's")
        ParallelDims(world=trainer.args.world_size, sp=size, ep=getattr(trainer.args, "expert_parallel_size", 1))
        if trainer.compute_loss_func is not None:
            raise ValueError(
                "compute_loss_func is not supported with sequence_parallel_size > 1 (the loss is sharded); drop it"
            )
        return cls(trainer, new_sequence_parallel_groups(sp_size=size))

    def shard_loader(self, loader: DataLoader) -> DataLoader:
        """Make an accelerate-prepared loader split batches over the DP ranks only (SP peers get the same batch)."""
        sampler = getattr(loader, "batch_sampler", None)
        if isinstance(loader, DataLoaderDispatcher):
            raise ValueError(
                "sequence parallelism needs each rank to load its own batches; set dispatch_batches=False "
                "(accelerator_config={'dispatch_batches': False}) or use a map-style dataset"
            )
        if isinstance(sampler, BatchSamplerShard):
            sampler.num_processes, sampler.process_index = self.groups.dp_size, self.groups.dp_rank
        elif isinstance(getattr(loader, "dataset", None), IterableDatasetShard):
            loader.dataset.num_processes, loader.dataset.process_index = self.groups.dp_size, self.groups.dp_rank
        elif self.groups.dp_size > 1:
            raise ValueError(f"cannot split {type(loader).__name__} batches over data-parallel ranks")
        return loader

    def compute_loss(
        self, trainer: Any, model, inputs: dict, return_outputs: bool, num_items_in_batch=None, long_sequence=None
    ):
        """The full-sequence causal-LM loss of this rank's SP group (see the module docstring for the scaling).

        `long_sequence` (a `TrainerLongSequence`) adds the tiled loss / tiled MLP switches.
        """
        inputs = dict(inputs)
        shift_labels = inputs.pop("shift_labels", None)
        inputs.pop("labels", None)  # the shard's unshifted labels: the targets are in shift_labels
        if shift_labels is None:
            raise ValueError("sequence-parallel training needs `labels` in the batch (the causal-LM targets)")
        tiled = long_sequence is not None and long_sequence.tiles_loss(model)
        extra = long_sequence.loss_kwargs(shift_labels) if tiled else {}
        forward = long_sequence.forward(model, shift_labels.shape[1]) if long_sequence else contextlib.nullcontext()
        with forward:
            outputs = model(**inputs, **extra)
        denominator = None
        if num_items_in_batch is not None:
            if trainer.args.average_tokens_across_devices and trainer.args.world_size > 1:
                # counted over every rank's shards: the world's tokens; this SP group's share of the DP mean
                denominator = num_items_in_batch / self.groups.dp_size
            else:
                denominator = torch.as_tensor(num_items_in_batch, device=shift_labels.device, dtype=torch.float32)
                denominator = denominator.clone()
                torch.distributed.all_reduce(denominator, group=self.groups.sp_group)
        group = self.groups.sp_group
        if tiled:  # the forward returned this rank's summed token losses
            loss = sequence_parallel_mean(outputs["loss"], shift_labels, group=group, num_items_in_batch=denominator)
            outputs["loss"] = loss
        else:
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]  # [B, S/P, V]
            loss = sequence_parallel_loss(logits, shift_labels, group=group, num_items_in_batch=denominator)
        return (loss, outputs) if return_outputs else loss


def _pad_id(trainer: Any) -> int:
    for source in (trainer.processing_class, getattr(trainer.model, "config", None)):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0
