"""Reused memory for the fused experts' weight gradients on CPU.

The experts' weight gradients are single `[E, ., .]` tensors (192 MiB for 64 experts of 256 x 1,024 in fp32).
glibc serves an allocation above 32 MiB with a fresh `mmap`, so after `zero_grad(set_to_none=True)` (the
Trainer's default) every backward faulted in and zero-filled new pages for them: ~13% of the layer's forward +
backward at 64 experts, 2,048 tokens, 1 thread (the layer of benchmarks/moe.py with and without this buffer).
A `GradientBuffer` keeps the storage of the last gradient it handed out and hands it out again once nothing else
holds that storage (the `.grad` it became was dropped); while anything still does (a `.grad` kept for gradient
accumulation, a hook's reference, a tensor returned by `torch.autograd.grad`), it allocates new memory, so a live
gradient is never overwritten.

The cost is that the last gradient's memory stays allocated between steps. CUDA's caching allocator already
reuses freed blocks, so the buffer is used for CPU tensors only.
"""

from __future__ import annotations

import torch

from hf_llmkit.compat.torch import storage_use_count


class GradientBuffer:
    """Hands out uninitialised tensors shaped like a weight, reusing the previous one's memory when it is free."""

    def __init__(self) -> None:
        self._storage: torch.UntypedStorage | None = None

    def empty_like(self, weight: torch.Tensor) -> torch.Tensor:
        """An uninitialised contiguous tensor with `weight`'s shape, dtype and device."""
        storage = self._storage
        nbytes = weight.numel() * weight.element_size()
        if (
            storage is not None
            and storage.device == weight.device
            and storage.nbytes() == nbytes
            and storage_use_count(storage) == 1  # only this buffer holds it (None: torch cannot tell, never reuse)
        ):
            return weight.new_empty(0).set_(storage, 0, weight.shape)  # no strides given: contiguous ones
        out = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        self._storage = out.untyped_storage() if weight.device.type == "cpu" else None
        return out

    def __deepcopy__(self, memo) -> GradientBuffer:
        return GradientBuffer()  # a copied module gets its own memory when it first needs it

    def __getstate__(self) -> dict:
        return {}  # never pickled with a module

    def __setstate__(self, state: dict) -> None:
        self._storage = None
