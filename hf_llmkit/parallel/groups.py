"""Process-group helpers shared by hf_llmkit's parallelisms (plain functions, keyword-only arguments)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


def new_expert_parallel_group(*, ep_size: int) -> dist.ProcessGroup:
    """This rank's expert-parallel group: the world split into consecutive blocks of `ep_size` ranks.

    Collective: every rank of the default group must call it (each block's group is created on all ranks,
    as `torch.distributed.new_group` requires). With `ep_size == world_size` it is the whole world.
    """
    if not dist.is_initialized():
        raise ValueError("new_expert_parallel_group needs torch.distributed initialised (init_process_group first)")
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
    if not dist.is_initialized():
        raise ValueError("new_sequence_parallel_groups needs torch.distributed initialised (init_process_group first)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if sp_size < 1 or world % sp_size:
        raise ValueError(
            f"sequence_parallel_size={sp_size} must be >= 1 and divide the world size {world}; "
            f"launch a multiple of {sp_size} ranks or pick a divisor of {world}"
        )
    dp_size = world // sp_size
    sp_group = dp_group = None
    for start in range(0, world, sp_size):
        group = dist.new_group(list(range(start, start + sp_size)))
        if start <= rank < start + sp_size:
            sp_group = group
    for offset in range(sp_size):
        group = dist.new_group(list(range(offset, world, sp_size)))
        if rank % sp_size == offset:
            dp_group = group
    return SequenceParallelGroups(
        sp_group=sp_group,
        dp_group=dp_group,
        sp_rank=rank % sp_size,
        sp_size=sp_size,
        dp_rank=rank // sp_size,
        dp_size=dp_size,
    )
