"""Ulysses sequence parallelism: the attention wrapper, batch sharding along the sequence and the group's loss."""

from hf_llmkit.parallel.sequence.data import SequenceParallelCollator, shard_sequence_batch
from hf_llmkit.parallel.sequence.loss import sequence_parallel_loss
from hf_llmkit.parallel.sequence.ulysses import (
    UlyssesAttention,
    apply_sequence_parallel,
    remove_sequence_parallel,
    sequence_parallel_group,
)

__all__ = [
    "SequenceParallelCollator",
    "UlyssesAttention",
    "apply_sequence_parallel",
    "remove_sequence_parallel",
    "sequence_parallel_group",
    "sequence_parallel_loss",
    "shard_sequence_batch",
]
