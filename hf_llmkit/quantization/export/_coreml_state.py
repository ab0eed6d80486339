"""The stateful decoder the Core ML export traces: a transformers causal LM whose key/value cache lives in two
float16 buffers (`keyCache`, `valueCache`: `[layers, batch, kv_heads, max_len, head_dim]`), which the converter
turns into Core ML states (`ct.StateType`, iOS 18+), so a device generates token by token without copying the cache
in or out.

`forward(input_ids [B, S], causal_mask [B, 1, S, end])`: the new tokens take cache slots `end - S .. end - 1` (their
positions), are written into both buffers in place, and attend to slots `0 .. end - 1` with the additive mask (0 to
attend, a large negative number not to: causality and padding are the caller's, as in Apple's stateful Llama
example). Returns the logits `[B, S, vocab]`.
"""

from __future__ import annotations

import torch
from torch import nn

KEY, VALUE = "keyCache", "valueCache"


class BufferCache:
    """The cache object transformers' attention layers call (`update`), writing into the wrapper's buffers."""

    is_compileable = False

    def __init__(self, owner: StatefulLM, past: torch.Tensor, end: torch.Tensor) -> None:
        self.owner, self.past, self.end = owner, past, end

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None):
        keys, values = getattr(self.owner, KEY), getattr(self.owner, VALUE)
        keys[layer_idx, :, :, self.past : self.end] = key_states.to(keys.dtype)
        values[layer_idx, :, :, self.past : self.end] = value_states.to(values.dtype)
        k = keys[layer_idx, :, :, : self.end].to(key_states.dtype)
        v = values[layer_idx, :, :, : self.end].to(value_states.dtype)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past


class StatefulLM(nn.Module):
    """`(input_ids, causal_mask) -> logits` of `model` with its cache in float16 buffers (module docstring)."""

    def __init__(self, model: nn.Module, *, batch_size: int, max_len: int, layers: int, heads: int, head_dim: int):
        super().__init__()
        self.m = model
        shape = (layers, batch_size, heads, max_len, head_dim)
        self.register_buffer(KEY, torch.zeros(shape, dtype=torch.float16))
        self.register_buffer(VALUE, torch.zeros(shape, dtype=torch.float16))

    def forward(self, input_ids: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        end = causal_mask.shape[-1]
        past = end - input_ids.shape[-1]
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device).unsqueeze(0) + past  # [1, S]
        out = self.m(
            input_ids=input_ids,
            attention_mask=causal_mask.float(),  # 4-D: transformers passes it to the attention as it is
            position_ids=positions,
            past_key_values=BufferCache(self, past, end),
            use_cache=True,
            return_dict=False,
        )
        return out[0]


def causal_mask(length: int, past: int = 0) -> torch.Tensor:
    """The float16 additive mask `[1, 1, length, past + length]` of `length` new tokens after `past` cached ones."""
    allowed = torch.arange(past + length)[None, :] <= (torch.arange(length) + past)[:, None]
    return torch.zeros(allowed.shape, dtype=torch.float16).masked_fill(~allowed, -1e4)[None, None]
