"""Peak tensor memory of a piece of CPU (or GPU) work, counted tensor by tensor: what `max_memory_allocated` reports
on CUDA, measured on any device.

`TensorMemory` is a `TorchDispatchMode`: every storage an ATen operator returns (forward, backward, collectives'
output buffers, recomputation under checkpointing) is added to a running total when it first appears and taken off
when it is freed (a weak-reference finalizer on the storage), and the peak of that total is kept. Storages that
existed before the block (parameters, their gradients when preallocated, the batch) are not counted. Not counted
either: scratch memory a kernel allocates and frees inside one operator, and allocator rounding/caching.

    with TensorMemory() as mem:
        loss = model(**batch).loss
        loss.backward()
    print(mem.peak_bytes)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorMemory(TorchDispatchMode):
    """Peak bytes of storages created inside the block and alive at the same time (see the module docstring)."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.device = device
        self.live: dict[int, int] = {}
        self.current = self.peak_bytes = 0

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or (self.device and t.device.type != self.device):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.live or key in inputs:  # a view or an in-place result: not new memory
                continue
            self.live[key] = size
            self.current += size
            self.peak_bytes = max(self.peak_bytes, self.current)
            weakref.finalize(storage, self._freed, key)
        return out
