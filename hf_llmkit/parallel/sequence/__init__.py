"""Ulysses sequence parallelism (the attention layer, batch sharding along the sequence, the group's loss) and the
ALST long-sequence techniques usable with or without it (tiled loss, tiled MLP, activation-checkpoint offload)."""

from hf_llmkit.parallel.sequence.data import SequenceParallelCollator, shard_sequence_batch
from hf_llmkit.parallel.sequence.loss import sequence_parallel_loss, sequence_parallel_mean
from hf_llmkit.parallel.sequence.offload import offload_saved_activations
from hf_llmkit.parallel.sequence.tiled_loss import TiledLoss, tiled_cross_entropy_sum
from hf_llmkit.parallel.sequence.tiled_mlp import TiledMLP
from hf_llmkit.parallel.sequence.ulysses import (
    UlyssesAttention,
    apply_sequence_parallel,
    remove_sequence_parallel,
    sequence_parallel_group,
)

__all__ = [
    "SequenceParallelCollator",
    "TiledLoss",
    "TiledMLP",
    "UlyssesAttention",
    "apply_sequence_parallel",
    "offload_saved_activations",
    "remove_sequence_parallel",
    "sequence_parallel_group",
    "sequence_parallel_loss",
    "sequence_parallel_mean",
    "shard_sequence_batch",
    "tiled_cross_entropy_sum",
]
