"""Per-layer prefix modules of P-tuning v2: a plain key/value table, or an MLP reparameterisation of one.

Both return `[2, kv_heads, num_virtual_tokens, head_dim]` (keys, then values) from `forward()`; calling them as
modules (rather than reading a Parameter) lets DeepSpeed ZeRO-3 gather their weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PlainPrefix(nn.Module):
    """Trainable prefix keys and values of one attention layer."""

    def __init__(self, *, kv_heads: int, num_virtual_tokens: int, head_dim: int, init_std: float = 1.0) -> None:
        super().__init__()
        self.prefix = nn.Parameter(torch.randn(2, kv_heads, num_virtual_tokens, head_dim) * init_std)

    def forward(self) -> torch.Tensor:
        return self.prefix  # [2, KVH, N, D]


def project_prefix(
    embedding: torch.Tensor,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor,
    up_weight: torch.Tensor,
    up_bias: torch.Tensor,
    kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """The prefix an MLP reparameterisation produces; shared by training and folding from a saved state dict."""
    hidden = torch.tanh(F.linear(embedding, down_weight, down_bias))  # [N, H]
    flat = F.linear(hidden, up_weight, up_bias)  # [N, 2 * KVH * D]
    n = embedding.shape[0]
    return flat.view(n, 2, kv_heads, head_dim).permute(1, 2, 0, 3)  # [2, KVH, N, D]


class ProjectedPrefix(nn.Module):
    """Prefix keys/values of one layer produced by `up(tanh(down(embedding)))` (used while training)."""

    def __init__(
        self, *, kv_heads: int, num_virtual_tokens: int, head_dim: int, token_dim: int, hidden: int, init_std: float
    ) -> None:
        super().__init__()
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.embedding = nn.Parameter(torch.randn(num_virtual_tokens, token_dim) * init_std)
        self.down = nn.Linear(token_dim, hidden)
        self.up = nn.Linear(hidden, 2 * kv_heads * head_dim)

    def forward(self) -> torch.Tensor:
        # Call the Linear modules (not F.linear on their weights) so ZeRO-3 gathers them. Outside autocast, in the
        # weights' precision, as `fold` / `fold_state` compute the prefix a save writes: the saved adapter then gives
        # the trained model's outputs under autocast too (the attention casts the prefix to the keys' dtype).
        with torch.autocast(self.embedding.device.type, enabled=False):
            hidden = torch.tanh(self.down(self.embedding))  # [N, H]
            flat = self.up(hidden)  # [N, 2 * KVH * D]
        return flat.view(flat.shape[0], 2, self.kv_heads, self.head_dim).permute(1, 2, 0, 3)  # [2, KVH, N, D]

    @torch.no_grad()
    def fold(self) -> PlainPrefix:
        """A `PlainPrefix` holding this module's current output (the inference form)."""
        value = self()
        plain = PlainPrefix(kv_heads=self.kv_heads, num_virtual_tokens=value.shape[2], head_dim=self.head_dim)
        plain.prefix.data = value.detach().clone().contiguous()
        return plain

    @staticmethod
    def fold_state(tensors: dict[str, torch.Tensor], kv_heads: int, head_dim: int) -> torch.Tensor:
        """The folded prefix from saved weights (`embedding`, `down.weight`, ... keys), e.g. a gathered ZeRO-3 dict."""
        args = [tensors[k] for k in ("embedding", "down.weight", "down.bias", "up.weight", "up.bias")]
        return project_prefix(*args, kv_heads=kv_heads, head_dim=head_dim).contiguous()
