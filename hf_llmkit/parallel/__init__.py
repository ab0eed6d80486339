"""Parallelism and sparse layers: mixture-of-experts (`MoELayer`, expert parallelism, `upcycle_to_moe`), Ulysses
sequence parallelism (`apply_sequence_parallel`, `shard_sequence_batch`, `sequence_parallel_loss`) and the ALST
long-sequence pieces (`TiledLoss`, `TiledMLP`, `offload_saved_activations`). Attention wrappers share one stack:
`hf_llmkit.parallel.attention`."""

from hf_llmkit.parallel.dims import MeshGroups, ParallelDims
from hf_llmkit.parallel.groups import (
    ExpertParallelGroups,
    SequenceParallelGroups,
    new_expert_parallel_group,
    new_expert_parallel_groups,
    new_sequence_parallel_groups,
)
from hf_llmkit.parallel.moe import (
    MoEAux,
    MoELayer,
    TopKRouter,
    apply_expert_parallel,
    load_balancing_loss,
    moe_blocks,
    moe_layers,
    router_z_loss,
    supported_architectures,
    upcycle_to_moe,
    use_moe_layers,
)
from hf_llmkit.parallel.sequence import (
    SequenceParallelCollator,
    TiledLoss,
    TiledMLP,
    UlyssesAttention,
    apply_sequence_parallel,
    offload_saved_activations,
    remove_sequence_parallel,
    sequence_parallel_group,
    sequence_parallel_loss,
    sequence_parallel_mean,
    shard_sequence_batch,
)

__all__ = [
    "ExpertParallelGroups",
    "MeshGroups",
    "MoEAux",
    "MoELayer",
    "ParallelDims",
    "SequenceParallelCollator",
    "SequenceParallelGroups",
    "TiledLoss",
    "TiledMLP",
    "TopKRouter",
    "UlyssesAttention",
    "apply_expert_parallel",
    "apply_sequence_parallel",
    "load_balancing_loss",
    "moe_blocks",
    "moe_layers",
    "new_expert_parallel_group",
    "new_expert_parallel_groups",
    "new_sequence_parallel_groups",
    "offload_saved_activations",
    "remove_sequence_parallel",
    "router_z_loss",
    "sequence_parallel_group",
    "sequence_parallel_loss",
    "sequence_parallel_mean",
    "shard_sequence_batch",
    "supported_architectures",
    "upcycle_to_moe",
    "use_moe_layers",
]
