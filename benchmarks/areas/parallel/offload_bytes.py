"""Bytes an activation-offload design moves to host memory in one training step, counted the same way for each.

`CopiedBytes` is a `TorchDispatchMode` that adds up the bytes every `aten.copy_` writes (the copy into a host
buffer is how transformers' `save_on_cpu`, DeepSpeed's `CheckpointHiddenStatesOffload` and hf_llmkit's
`offload_saved_activations` all move a tensor). `moved_bytes(plain, offloaded)` runs one training step without and
one with the design and returns the difference: what the design copied, whatever the model copies by itself. On an
accelerator those bytes cross to the host in the forward and come back in the backward; on a CPU-only machine a
design either copies host to host (transformers' `save_on_cpu`; hf_llmkit's with `include_cpu=True`) or skips
tensors that are not on an accelerator (DeepSpeed's: 0 bytes there).

    moved = moved_bytes(lambda: step(checkpointed), lambda: step(checkpointed_and_offloaded))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CopiedBytes(TorchDispatchMode):
    """Bytes written by `aten.copy_` inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        if func is torch.ops.aten.copy_.default:
            self.bytes += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


def moved_bytes(plain: Callable[[], Any], offloaded: Callable[[], Any]) -> int:
    """Bytes `aten.copy_` wrote in `offloaded()` (a step with the design) minus in `plain()` (the same without)."""
    with CopiedBytes() as without:
        plain()
    with CopiedBytes() as with_design:
        offloaded()
    return with_design.bytes - without.bytes


def offload_rows(designs: dict[str, dict]) -> list[list[str]]:
    """The table of a run's designs (name -> {"bytes", "x_layer_input"} or {"error"}), header first."""
    rows = [["design", "MiB per step", "x one layer input [B, S, H]"]]
    for name, got in designs.items():
        if "error" in got:
            rows.append([name, "did not run", got["error"][:80]])
        else:
            rows.append([name, f"{got['bytes'] / 2**20:.2f}", f"{got['x_layer_input']:.2f}"])
    return rows
