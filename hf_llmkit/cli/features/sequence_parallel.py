"""Sequence parallelism: `--sequence_parallel_size` (an `LLMKitTrainingArguments` field; `LLMKitTrainer` shards
the sequences), checked here against the model's attention heads before any training."""

from __future__ import annotations

from hf_llmkit.cli.features.base import BuildState, Feature

__all__ = ["SEQUENCE_PARALLEL"]


class SequenceParallel(Feature):
    name = "sequence_parallel"
    stage = 30
    row = "sequence parallel"
    row_when_off = "off"

    def folder_suffix(self, values):
        size = values["sequence_parallel_size"]
        return f"sp{size}" if size > 1 else None

    def model_stage(self, args, state: BuildState) -> None:
        size = args.training.sequence_parallel_size
        if size > 1:
            from hf_llmkit.parallel.sequence.ulysses import kv_replication

            config = state.model.config
            heads = config.num_attention_heads  # the heads must split over the ranks of a sequence
            kv_replication(heads, getattr(config, "num_key_value_heads", None) or heads, size)

    def describe(self, args):
        size = args.training.sequence_parallel_size
        return f"{size} ranks per sequence" if size > 1 else None


SEQUENCE_PARALLEL = SequenceParallel()
