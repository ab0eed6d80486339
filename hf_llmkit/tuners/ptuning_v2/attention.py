"""The attention function that prepends P-tuning v2 prefixes, registered with `transformers.AttentionInterface`.

Models call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, attention_mask,
**kwargs)` from inside each attention layer, after the KV cache was updated. `register_prefix_attention("sdpa")`
registers `"ptuning_v2_sdpa"`, which takes the layer's prefix from a keyword argument (passed in by the tuner layer
that wraps the attention module), prepends it to `key`/`value`, extends the mask by always-visible columns, and calls
the implementation the model used before. The prefix never enters the cache, so generation with a cache prepends it
at every step and the model's mask (built for the cached tokens only) stays aligned; RoPE is applied to real keys
only, so positions are those of the unprompted model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PREFIX_KWARG = "ptuning_v2_prefix"
NAME_PREFIX = "ptuning_v2_"


def is_prefix_attention(name: str | None) -> bool:
    return bool(name) and name.startswith(NAME_PREFIX)


def inner_name(name: str) -> str:
    """The implementation a registered prefix attention delegates to (`"ptuning_v2_sdpa"` -> `"sdpa"`)."""
    return name[len(NAME_PREFIX) :]


def _inner_function(inner: str, module: torch.nn.Module) -> Callable[..., Any]:
    if inner == "eager":
        # "eager" is not in the global registry: each model file defines its own eager_attention_forward.
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise ValueError(
                f"{type(module).__name__} has no eager_attention_forward in its module; load the model with "
                "attn_implementation='sdpa'"
            )
        return fn
    return ALL_ATTENTION_FUNCTIONS[inner]


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


def prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    inner: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    prefix = kwargs.pop(PREFIX_KWARG, None)  # [2, KVH, P, D]
    fn = _inner_function(inner, module)
    if prefix is None:
        return fn(module, query, key, value, attention_mask, **kwargs)
    batch, q_len, kv_len = key.shape[0], query.shape[2], key.shape[2]
    if prefix.shape[1] != key.shape[1]:
        raise ValueError(
            f"prefix has {prefix.shape[1]} key/value heads but {type(module).__name__} uses {key.shape[1]}; the "
            "adapter was made for another model"
        )
    prefix = prefix.to(dtype=key.dtype, device=key.device)
    key = torch.cat([prefix[0].unsqueeze(0).expand(batch, -1, -1, -1), key], dim=2)  # [B, KVH, P + K, D]
    value = torch.cat([prefix[1].unsqueeze(0).expand(batch, -1, -1, -1), value], dim=2)  # [B, KVH, P + K, D]
    if attention_mask is None and "flash" not in inner:
        # The model relied on `is_causal`, which sdpa aligns top-left: wrong once the keys are longer than the
        # queries, so spell the causal pattern out. Flash kernels align bottom-right and need nothing.
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if is_causal and q_len > 1:
            attention_mask = _causal_mask(q_len, kv_len, query.device)
            if inner != "sdpa":  # eager-style functions add the mask to the scores
                zero = torch.zeros((), dtype=query.dtype, device=query.device)
                attention_mask = torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
            kwargs["is_causal"] = False
    if attention_mask is not None:
        attention_mask = _extend_mask(attention_mask, prefix.shape[2])
    return fn(module, query, key, value, attention_mask, **kwargs)


class _PrefixAttention:
    """`prefix_attention` bound to one inner implementation (a class, not a lambda, so it pickles and prints)."""

    def __init__(self, inner: str) -> None:
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return prefix_attention(*args, inner=self.inner, **kwargs)

    def __repr__(self) -> str:
        return f"prefix_attention(inner={self.inner!r})"


def register_prefix_attention(inner: str) -> str:
    """Register (once) the prefix attention wrapping `inner` and its mask function; returns its name."""
    if is_prefix_attention(inner):
        return inner
    name = NAME_PREFIX + inner
    if name not in ALL_ATTENTION_FUNCTIONS:
        if inner != "eager" and inner not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"attention implementation {inner!r} is not registered with transformers")
        AttentionInterface.register(name, _PrefixAttention(inner))
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(inner)
    if mask_fn is not None and name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        # Masks are built for the real tokens exactly as the inner implementation expects them.
        AttentionMaskInterface.register(name, mask_fn)
    return name
