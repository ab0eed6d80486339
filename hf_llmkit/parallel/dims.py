"""The parallel degrees of a run, validated together in one place: world = dp x sp x ep.

As torchtitan's `ParallelDims`: `ParallelDims(world=..., sp=..., ep=...)` is the only place that decides whether a
layout of ranks is valid (each degree at least 1 and dividing the world; sequence and expert parallelism not
combined), and `dims.groups()` the only builder of its process groups. `LLMKitTrainingArguments` checks the degrees
with it when the arguments are built (before any work), the trainer's sequence- and expert-parallel set-ups when
they start.

    dims = ParallelDims(world=4, sp=2)        # dp = 2
    groups = dims.groups()                    # collective: this rank's SP group and its DP group
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["MeshGroups", "ParallelDims"]

_FLAGS = {"sp": "sequence_parallel_size", "ep": "expert_parallel_size"}


@dataclass(frozen=True)
class MeshGroups:
    """This rank's place in a dp x (sp or ep) layout: the model-parallel degree splits blocks of consecutive ranks.

    Ranks `[k * size, (k + 1) * size)` form model-parallel group `k` (`block`: they share a batch's sequence, or
    hold the experts between them); ranks with the same place in their block form one data-parallel group
    (`stride`: they see different batches, and sum the gradients of what they hold alike).
    """

    block: dist.ProcessGroup
    stride: dist.ProcessGroup
    block_rank: int
    block_size: int
    stride_rank: int
    stride_size: int


@dataclass(frozen=True)
class ParallelDims:
    """The run's degrees: `world` ranks, `sp` ranks per sequence, `ep` ranks per set of experts (dp is the rest)."""

    world: int
    sp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("sp", "ep"):
            size = getattr(self, name)
            if size < 1 or self.world % size:
                raise ValueError(
                    f"{_FLAGS[name]}={size} must be >= 1 and divide the number of ranks ({self.world}); "
                    f"launch a multiple of it (e.g. --num_processes {max(size, 1)})"
                )
        if self.sp > 1 and self.ep > 1:
            raise ValueError("expert_parallel_size > 1 cannot be combined with sequence_parallel_size > 1; pick one")

    @property
    def dp(self) -> int:
        return self.world // (self.sp * self.ep)

    @classmethod
    def of_world(cls, *, sp: int = 1, ep: int = 1) -> ParallelDims:
        """The degrees over the initialised default process group."""
        if not dist.is_initialized():
            raise ValueError("parallel groups need torch.distributed initialised (init_process_group first)")
        return cls(world=dist.get_world_size(), sp=sp, ep=ep)

    def block_groups(self) -> list[dist.ProcessGroup]:
        """Every model-parallel block's group, in order (collective: created on all ranks, as `new_group` needs)."""
        size = self.sp * self.ep
        return [dist.new_group(list(range(start, start + size))) for start in range(0, self.world, size)]

    def groups(self) -> MeshGroups:
        """This rank's model-parallel block and data-parallel stride groups (collective: every rank of the default
        group calls it, in the same order as its other `new_group` calls)."""
        size, rank = self.sp * self.ep, dist.get_rank()
        block = self.block_groups()[rank // size]
        strides = [dist.new_group(list(range(offset, self.world, size))) for offset in range(size)]
        return MeshGroups(
            block=block, stride=strides[rank % size], block_rank=rank % size, block_size=size,
            stride_rank=rank // size, stride_size=self.dp,
        )  # fmt: skip
