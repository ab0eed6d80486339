"""Process-group helpers shared by hf_llmkit's parallelisms (plain functions, keyword-only arguments)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


def new_expert_parallel_group(*, ep_size: int) -> dist.ProcessGroup:
    """This rank's expert-parallel group: the world split into consecutive blocks of `ep_size` ranks.

    Collective: every rank of the default group must call it (each block's group is created on all ranks,
    as `torch.distributed.new_group` requires). With `ep_size == world_size` it is the whole world.
    """
    _check_initialised("new_expert_parallel_group")
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size} must be >= 1 and divide the world size {world}")
    mine = None
    for start in range(0, world, ep_size):
        group = dist.new_group(list(range(start, start + ep_size)))
        if start <= rank < start + ep_size:
            mine = group
    return mine


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
    _check_initialised("new_expert_parallel_groups")
    ep_group, replica_group = _blocks_and_strides(size=ep_size, flag="expert_parallel_size")
    world, rank = dist.get_world_size(), dist.get_rank()
    return ExpertParallelGroups(
        ep_group=ep_group,
        replica_group=replica_group,
        ep_rank=rank % ep_size,
        ep_size=ep_size,
        replica_rank=rank // ep_size,
        num_replicas=world // ep_size,
    )


def _check_initialised(what: str) -> None:
    if not dist.is_initialized():
        raise ValueError(f"{what} needs torch.distributed initialised (init_process_group first)")


def _blocks_and_strides(*, size: int, flag: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's block of `size` consecutive ranks and its group of ranks `size` apart (same place in a block).

    Collective: creates every block group, then every strided group, on all ranks (`new_group` requires it).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(
            f"{flag}={size} must be >= 1 and divide the world size {world}; "
            f"launch a multiple of {size} ranks or pick a divisor of {world}"
        )
    block = new_expert_parallel_group(ep_size=size)
    strided = None
    for offset in range(size):
        group = dist.new_group(list(range(offset, world, size)))
        if rank % size == offset:
            strided = group
    return block, strided


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
    _check_initialised("new_sequence_parallel_groups")
    sp_group, dp_group = _blocks_and_strides(size=sp_size, flag="sequence_parallel_size")
    world, rank = dist.get_world_size(), dist.get_rank()
    return SequenceParallelGroups(
        sp_group=sp_group,
        dp_group=dp_group,
        sp_rank=rank % sp_size,
        sp_size=sp_size,
        dp_rank=rank // sp_size,
        dp_size=world // sp_size,
    )
