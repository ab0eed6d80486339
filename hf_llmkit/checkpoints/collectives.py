"""The three collective helpers the callbacks need, no-ops without a process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["any_rank", "barrier", "world_size"]


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    """Wait for every rank (a no-op on one process)."""
    if world_size() > 1:
        dist.barrier()


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """True on every rank when `flag` is True on at least one (a no-op without a process group)."""
    if world_size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
