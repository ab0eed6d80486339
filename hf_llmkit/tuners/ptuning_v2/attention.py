"""The P-tuning v2 layer of hf_llmkit's attention stack: prefix keys/values prepended inside attention.

Models call the registered attention function from inside each attention layer, after the KV cache was updated.
`PrefixAttention` is a layer of the shared stack (`hf_llmkit.parallel.attention`): it takes the layer's prefix
from a keyword argument (passed in by the tuner layer that wraps the attention module), prepends it to
`key`/`value`, extends the mask by always-visible columns, and calls the rest of the stack (the model's kernel).
Under Ulysses sequence parallelism, which sits outside it, it runs on the full sequence and the prefix holds only
the key/value heads of this rank (the prefix keyword is declared head-sharded). The prefix never enters the cache,
so generation with a cache prepends it at every step and the model's mask (built for the cached tokens only) stays
aligned; RoPE is applied to real keys only, so positions are those of the unprompted model.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from hf_llmkit.parallel.attention import (
    AttentionCall,
    AttentionLayer,
    register_head_sharded_kwarg,
    register_stack,
    stack_named,
)

PREFIX_KWARG = "ptuning_v2_prefix"
register_head_sharded_kwarg(PREFIX_KWARG, dim=1)  # [2, KVH, P, D]


def _causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Bottom-right aligned causal mask `[1, 1, Q, K]` (True = attend): query i sits at position kv_len - q_len + i."""
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return (torch.arange(kv_len, device=device)[None, :] <= rows)[None, None]


def _extend_mask(mask: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """Prepend `num_prefix` always-visible key columns to a 4D (bool or additive float) or 2D padding mask."""
    shape = (*mask.shape[:-1], num_prefix)
    if mask.dtype == torch.bool:
        visible = torch.ones(shape, dtype=torch.bool, device=mask.device)
    elif mask.dim() == 2:  # 2D padding masks (flash attention) are 1 = keep
        visible = torch.ones(shape, dtype=mask.dtype, device=mask.device)
    else:  # additive float mask: 0 = attend
        visible = torch.zeros(shape, dtype=mask.dtype, device=mask.device)
    return torch.cat([visible, mask], dim=-1)


class PrefixAttention(AttentionLayer):
    """Prepends the P-tuning v2 prefix handed in as `ptuning_v2_prefix=` (`[2, KVH, P, D]`) to keys and values."""

    kind = "ptuning_v2"
    order = 10  # inside Ulysses (order 0): the prefixes join the full-sequence attention of each head shard
    name_prefix = "ptuning_v2_"

    def check_kernel(self, kernel: str) -> None:
        if kernel != "eager" and kernel not in AttentionInterface():
            raise ValueError(f"attention implementation {kernel!r} is not registered with transformers")

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,  # [B, H, Q, D]
        key: torch.Tensor,  # [B, KVH, K, D]
        value: torch.Tensor,  # [B, KVH, K, D]
        attention_mask: torch.Tensor | None,
        *,
        inner: AttentionCall,
        kernel: str,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        prefix = kwargs.pop(PREFIX_KWARG, None)  # [2, KVH, P, D]
        if prefix is None:
            return inner(module, query, key, value, attention_mask, **kwargs)
        batch, q_len, kv_len = key.shape[0], query.shape[2], key.shape[2]
        if prefix.shape[1] != key.shape[1]:
            raise ValueError(
                f"prefix has {prefix.shape[1]} key/value heads but {type(module).__name__} uses {key.shape[1]}; the "
                "adapter was made for another model"
            )
        prefix = prefix.to(dtype=key.dtype, device=key.device)
        key = torch.cat([prefix[0].unsqueeze(0).expand(batch, -1, -1, -1), key], dim=2)  # [B, KVH, P + K, D]
        value = torch.cat([prefix[1].unsqueeze(0).expand(batch, -1, -1, -1), value], dim=2)  # [B, KVH, P + K, D]
        if attention_mask is None and "flash" not in kernel:
            # The model relied on `is_causal`, which sdpa aligns top-left: wrong once the keys are longer than the
            # queries, so spell the causal pattern out. Flash kernels align bottom-right and need nothing.
            is_causal = kwargs.get("is_causal")
            is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
            if is_causal and q_len > 1:
                attention_mask = _causal_mask(q_len, kv_len, query.device)
                if kernel != "sdpa":  # eager-style functions add the mask to the scores
                    zero = torch.zeros((), dtype=query.dtype, device=query.device)
                    attention_mask = torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
                kwargs["is_causal"] = False
        if attention_mask is not None:
            attention_mask = _extend_mask(attention_mask, prefix.shape[2])
        return inner(module, query, key, value, attention_mask, **kwargs)


# --- names, for callers that switch implementations by name ---------------------------------------------------


def is_prefix_attention(name: str | None) -> bool:
    """Whether the implementation `name` includes the P-tuning v2 layer."""
    return stack_named(name).find(PrefixAttention.kind) is not None


def register_prefix_attention(inner: str) -> str:
    """Register the stack `inner` (a kernel or one of our stack names) plus the P-tuning v2 layer; returns its name."""
    return register_stack(stack_named(inner).with_layer(PrefixAttention()))


def inner_name(name: str) -> str:
    """The implementation a stack runs without its P-tuning v2 layer (`"ptuning_v2_sdpa"` -> `"sdpa"`)."""
    return register_stack(stack_named(name).without(PrefixAttention.kind))
