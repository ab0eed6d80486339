"""In/out features of the modules hf_llmkit's tuner layers wrap, the numbers peft's layers expose.

Read from module attributes, never `weight.shape`: under DeepSpeed ZeRO-3 a partitioned weight has an empty local
shape.
"""

from __future__ import annotations

from torch import nn
from transformers import Conv1D


def linear_features(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a Linear-like module, or None: nn.Linear (bitsandbytes layers included), GPT-2's Conv1D, or any
    layer that declares `in_features` / `out_features` as peft's layers do."""
    if isinstance(module, Conv1D):
        return module.nx, module.nf
    if isinstance(module, nn.Linear) or (hasattr(module, "in_features") and hasattr(module, "out_features")):
        return module.in_features, module.out_features
    return None
