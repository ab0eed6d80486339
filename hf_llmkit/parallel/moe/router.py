"""Softmax top-k router and the router's auxiliary losses.

The router matches transformers' `MixtralTopKRouter` / `Qwen2MoeTopKRouter` (a bias-free `weight [E, H]`,
softmax in fp32, top-k, optional renormalisation), so its state dict is theirs. The losses follow
Switch Transformer (load balancing) and ST-MoE (z-loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TopKRouter(nn.Module):
    """Routes each token to `top_k` of `num_experts` experts.

    Args:
        hidden_size: width of the tokens routed.
        num_experts: number of experts (over all expert-parallel ranks).
        top_k: experts chosen per token.
        normalize_top_k: rescale the chosen probabilities to sum to 1 (Mixtral always does; Qwen2-MoE's
            `norm_topk_prob`).
        jitter_noise: in training, multiply the router's input by uniform noise in [1 - eps, 1 + eps]
            (Switch Transformer); only the router sees the noise, experts get the clean tokens.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        normalize_top_k: bool = True,
        jitter_noise: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.jitter_noise = jitter_noise
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route `tokens [T, H]`; returns logits `[T, E]`, fp32 probs `[T, E]`, weights `[T, K]`, experts `[T, K]`."""
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(tokens).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            tokens = tokens * noise
        logits = F.linear(tokens, self.weight)  # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights.to(tokens.dtype), experts

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, normalize_top_k={self.normalize_top_k}, "
            f"jitter_noise={self.jitter_noise}"
        )


def load_balancing_loss(probs: torch.Tensor, expert_counts: torch.Tensor) -> torch.Tensor:
    """Switch-style balancing loss `E * sum_e f_e * P_e` for top-k routing.

    `f_e` is the fraction of tokens that chose expert e (it sums to top_k) and `P_e` the mean router
    probability of e; a perfectly uniform router scores `top_k`. This is the quantity transformers'
    `load_balancing_loss_func` computes (without padding mask), so `router_aux_loss_coef` means the same.
    """
    num_tokens, num_experts = probs.shape
    fraction = expert_counts.to(probs.dtype) / max(num_tokens, 1)  # [E]
    return num_experts * torch.sum(fraction * probs.mean(dim=0))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of `logsumexp(logits)^2`; keeps router logits small."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
