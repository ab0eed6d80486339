"""Saved-activation offload for a scope of your own: every tensor autograd saves inside it goes to host memory.

`offload_saved_activations()` moves everything saved for backward while it is active, to pinned host memory on an
accelerator: wrapped around a whole forward, that is each checkpointed layer's input plus what runs outside the
layers (the final norm, the LM head's input, the logits when they are built), several times what the per-checkpoint
design moves (`benchmarks/sequence_parallel.py` reports the bytes of both). Inside a checkpointed region torch's own
checkpoint hooks take precedence, so recomputed activations stay on the device.

`LLMKitTrainingArguments(offload_activation_checkpoints=True)` does not use it: it asks transformers' own
per-checkpoint offload (`activation_checkpointing_kwargs={"offload": True}`: `save_on_cpu` around each checkpointed
layer's call), which moves each layer's input only. Use this context manager for a scope you choose, e.g. around a
single checkpointed call in a loop of your own.

Tensors already on the CPU are kept as they are: on a machine without an accelerator this is a no-op that runs the
same hooks (`include_cpu=True` copies them too, which tests use to exercise the copy path). Parameters (and
their views, e.g. the transposed weight a matmul saves) are never copied: they stay where they live.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks

from hf_llmkit.compat.torch import view_base

_PACKED = tuple[torch.device, torch.Tensor]


def _pinnable() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


class offload_saved_activations(saved_tensors_hooks):  # noqa: N801 - a context manager, named like torch's
    """Context manager: tensors autograd saves inside it live in (pinned) host memory until backward.

    Args:
        min_bytes: tensors smaller than this stay where they are (copies of small tensors cost more than they free).
        include_cpu: also copy tensors that are already on the CPU (a test hook for the copy path).
    """

    def __init__(self, *, min_bytes: int = 1 << 16, include_cpu: bool = False) -> None:
        self.copied_bytes = 0
        pin = _pinnable()

        def pack(tensor: torch.Tensor) -> torch.Tensor | _PACKED:
            if (
                (tensor.device.type == "cpu" and not include_cpu)
                or isinstance(tensor, torch.nn.Parameter)
                or isinstance(view_base(tensor), torch.nn.Parameter)  # a weight's transpose, saved by a matmul
                or tensor.is_sparse
                or tensor.numel() * tensor.element_size() < min_bytes
            ):
                return tensor
            host = torch.empty_like(tensor, device="cpu", pin_memory=pin)  # dense layouts keep their strides
            host.copy_(tensor, non_blocking=pin)
            self.copied_bytes += host.numel() * host.element_size()
            return (tensor.device, host)

        def unpack(packed: torch.Tensor | _PACKED) -> torch.Tensor:
            if torch.is_tensor(packed):
                return packed
            device, host = packed
            return host.to(device, non_blocking=pin) if device.type != "cpu" else host

        super().__init__(pack, unpack)

    def __enter__(self) -> offload_saved_activations:
        super().__enter__()
        return self
