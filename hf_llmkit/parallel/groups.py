"""Process-group helpers shared by hf_llmkit's parallelisms (plain functions, keyword-only arguments): each is a view
of the one layout `hf_llmkit.parallel.dims.ParallelDims` validates and builds (world = dp x sp x ep)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from hf_llmkit.parallel.dims import ParallelDims


def new_expert_parallel_group(*, ep_size: int) -> dist.ProcessGroup:
    """This rank's expert-parallel group: the world split into consecutive blocks of `ep_size` ranks.

    Collective: every rank of the default group must call it (each block's group is created on all ranks,
    as `torch.distributed.new_group` requires). With `ep_size == world_size` it is the whole world.
    """
    return ParallelDims.of_world(ep=ep_size).block_groups()[dist.get_rank() // ep_size]


@dataclass(frozen=True)
class ExpertParallelGroups:
    """This rank's place in a data-parallel x expert-parallel layout (world = replicas * ep_size).

    Ranks `[k * ep_size, (k + 1) * ep_size)` form expert-parallel group `k`: together they hold every expert once
    (rank `i` of the group holds shard `i`) and exchange tokens. Ranks with the same position in their EP group
    hold the same expert shard: they form one expert data-parallel group (`replica_group`), over which that
    shard's gradients are summed. Dense (non-expert) parameters are replicated over the whole world.
    """

    ep_group: dist.ProcessGroup
    replica_group: dist.ProcessGroup
    ep_rank: int
    ep_size: int
    replica_rank: int
    num_replicas: int


def new_expert_parallel_groups(*, ep_size: int) -> ExpertParallelGroups:
    """Split the world into `world // ep_size` EP groups of consecutive ranks and the matching replica groups.

    Collective: every rank of the default group must call it, in the same order as its other `new_group` calls.
    """
    mesh = ParallelDims.of_world(ep=ep_size).groups()
    return ExpertParallelGroups(
        ep_group=mesh.block, replica_group=mesh.stride, ep_rank=mesh.block_rank, ep_size=mesh.block_size,
        replica_rank=mesh.stride_rank, num_replicas=mesh.stride_size,
    )  # fmt: skip


@dataclass(frozen=True)
class SequenceParallelGroups:
    """This rank's place in a data-parallel x sequence-parallel layout (world = dp_size * sp_size).

    Ranks `[k * sp_size, (k + 1) * sp_size)` form SP group `k` (they share one batch and split its sequence);
    ranks with the same position inside their SP group form one DP group (they see different batches).
    """

    sp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    sp_rank: int
    sp_size: int
    dp_rank: int
    dp_size: int


def new_sequence_parallel_groups(*, sp_size: int) -> SequenceParallelGroups:
    """Split the world into `world // sp_size` SP groups of consecutive ranks and the matching DP groups.

    Collective: every rank of the default group must call it, in the same order as its other `new_group` calls.
    """
    mesh = ParallelDims.of_world(sp=sp_size).groups()
    return SequenceParallelGroups(
        sp_group=mesh.block, dp_group=mesh.stride, sp_rank=mesh.block_rank, sp_size=mesh.block_size,
        dp_rank=mesh.stride_rank, dp_size=mesh.stride_size,
    )  # fmt: skip
