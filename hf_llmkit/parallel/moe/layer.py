"""`MoELayer`: a sparse mixture-of-experts MLP that drops into a transformers decoder layer.

Its state dict is transformers' own (`gate.weight`, `experts.gate_up_proj`, `experts.down_proj`, and for
Qwen2-MoE `shared_expert.*` / `shared_expert_gate.weight`), so exporting to Mixtral or Qwen2-MoE is a
rename-free copy. `forward` returns only the hidden states (the MLP contract of a decoder layer); the
auxiliary losses and routing statistics of the last call are left in `layer.aux` (`MoEAux`), where
`LLMKitTrainer` collects them.

Example:
    ```python
    from hf_llmkit.parallel import MoELayer

    moe = MoELayer(hidden_size=256, intermediate_size=1024, num_experts=8, top_k=2)
    out = moe(hidden_states)  # [B, S, 256]
    loss = task_loss + 0.01 * moe.aux.load_balancing_loss + 0.001 * moe.aux.z_loss
    ```
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers.activations import ACT2FN

from hf_llmkit.compat.transformers import record_router_logits
from hf_llmkit.parallel.moe.dispatch import combine, dispatch, rows_to_tokens, slot_positions, tokens_to_rows
from hf_llmkit.parallel.moe.experts import FusedExperts
from hf_llmkit.parallel.moe.router import TopKRouter
from hf_llmkit.parallel.moe.routing_stats import RoutingRecord, record_routing


@dataclass
class MoEAux:
    """What one `MoELayer.forward` leaves behind for the loss and the logs.

    Args:
        load_balancing_loss: Switch-style balancing loss (differentiable; `top_k` when perfectly balanced).
        z_loss: router z-loss (differentiable).
        expert_load: tokens routed to each expert in this call, `[num_experts]` (before dropping).
        dropped_fraction: fraction of routed (token, expert) pairs dropped by the capacity limit.
    """

    load_balancing_loss: torch.Tensor
    z_loss: torch.Tensor
    expert_load: torch.Tensor
    dropped_fraction: torch.Tensor


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a SwiGLU MLP scaled by `sigmoid(shared_expert_gate(x))`."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, **factory):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **factory)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _check_args(num_experts: int, top_k: int, capacity_factor: float | None, jitter_noise: float, ep_size: int):
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be between 1 and num_experts={num_experts}, got top_k={top_k}; lower top_k")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for dropless routing), got {capacity_factor}")
    if not 0.0 <= jitter_noise < 1.0:
        raise ValueError(f"jitter_noise must be in [0, 1), got {jitter_noise}")
    if num_experts % ep_size:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the expert-parallel group size {ep_size}; "
            "choose num_experts as a multiple of the group size or a smaller expert-parallel group"
        )


class MoELayer(nn.Module):
    """Top-k routed mixture of SwiGLU experts, dropless by default, optionally expert-parallel.

    Args:
        hidden_size: model width H.
        intermediate_size: width I of each expert.
        num_experts: experts in total (over the expert-parallel group).
        top_k: experts per token (at most `num_experts`).
        hidden_act: expert activation (a transformers `ACT2FN` name).
        normalize_top_k: renormalise the chosen router probabilities to sum to 1 (Mixtral: always).
        jitter_noise: multiplicative uniform noise on the router input during training (0 = off).
        capacity_factor: None = dropless; else each expert takes at most
            `ceil(capacity_factor * tokens * top_k / num_experts)` rows per call (per rank), in token order, and
            the rest are dropped (their contribution is zero; the residual stream carries them).
        shared_expert_intermediate_size: width of a Qwen2-MoE shared expert (None = no shared expert; 0 = a
            zero-width placeholder that adds exactly nothing, as upcycled Qwen2 models export).
        ep_group: process group experts are sharded over (None = all experts local). Every rank of the group
            must call forward together; each holds experts `[rank * E/P, (rank + 1) * E/P)`. A rank's expert
            gradients already sum the tokens of the whole group: to match data-parallel training without expert
            parallelism, sum them over the ranks holding the same experts and divide by the world size (keep them
            out of a world-wide DDP average; `LLMKitTrainer(expert_parallel_size=P)` does this).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        num_experts: int,
        top_k: int = 2,
        hidden_act: str = "silu",
        normalize_top_k: bool = True,
        jitter_noise: float = 0.0,
        capacity_factor: float | None = None,
        shared_expert_intermediate_size: int | None = None,
        ep_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        _check_args(num_experts, top_k, capacity_factor, jitter_noise, 1)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor = capacity_factor
        self.ep_group, self.ep_size, self.ep_rank = None, 1, 0
        self.num_local_experts, self.replicated_experts = num_experts, False
        factory = {"device": device, "dtype": dtype}
        self.gate = TopKRouter(
            hidden_size, num_experts, top_k, normalize_top_k=normalize_top_k, jitter_noise=jitter_noise, **factory
        )
        record_router_logits(self.gate)  # inside a Mixtral / Qwen2-MoE model: `output_router_logits=True` sees them
        # All E experts are drawn, then this rank keeps its slice: with one seed, EP=P holds the EP=1 weights.
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, hidden_act, **factory)
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_intermediate_size is not None:
            self.shared_expert = SharedExpert(hidden_size, shared_expert_intermediate_size, hidden_act, **factory)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, **factory)
        self.aux: MoEAux | None = None
        if ep_group is not None:
            self.enable_expert_parallel_(ep_group)

    @torch.no_grad()
    def enable_expert_parallel_(self, group: dist.ProcessGroup, *, shard_weights: bool = True) -> None:
        """Split the experts over `group`: this rank computes experts `[rank * E/P, (rank + 1) * E/P)`.

        With `shard_weights` (default) the other experts' weights are dropped here; otherwise every rank keeps
        all of them (replicated, e.g. for DeepSpeed ZeRO, which partitions their optimizer state itself) and
        only computes its own, so their gradients are zero on this rank.
        """
        if self.ep_group is not None:
            raise ValueError("this MoELayer is already expert-parallel; build a fresh layer for another group")
        ep_size = dist.get_world_size(group)
        _check_args(self.num_experts, self.top_k, self.capacity_factor, self.gate.jitter_noise, ep_size)
        self.ep_group, self.ep_size, self.ep_rank = group, ep_size, dist.get_rank(group)
        self.num_local_experts, self.replicated_experts = self.num_experts // ep_size, not shard_weights
        if shard_weights and ep_size > 1:
            self.experts.keep_experts_(self.ep_rank * self.num_local_experts, self.num_local_experts)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        num_tokens, k = x.shape[0], self.top_k
        logits, probs, weights, experts = self.gate(x)  # [T, E], [T, E], [T, K], [T, K]

        with torch.no_grad():
            flat = experts.reshape(-1)  # [T*K] expert of each (token, slot)
            load = torch.bincount(flat, minlength=self.num_experts)  # [E]
            order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order inside
            counts = load
            if self.capacity_factor is not None:
                capacity = math.ceil(self.capacity_factor * num_tokens * k / self.num_experts)
                starts = load.cumsum(0) - load
                rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
                order = order[rank_in_expert < capacity]
                counts = load.clamp(max=capacity)
            pos = slot_positions(order, flat.numel())  # [T*K] row of each (token, slot)

        rows = tokens_to_rows(x, order, pos, k)  # [N, H] sorted by expert
        if self.ep_group is None:
            out_rows = self.experts(rows, counts.tolist())
        else:
            local_rows, local_counts, plan = dispatch(rows, counts, group=self.ep_group)
            first = self.ep_rank * self.num_local_experts if self.replicated_experts else 0
            out_rows = combine(self.experts(local_rows, local_counts, first_expert=first), plan, group=self.ep_group)
        out = rows_to_tokens(out_rows, weights, order, pos)  # [T, H] weighted sum over each token's K slots
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

        call = RoutingRecord.of_call(logits, experts, probs=probs, kept=order.numel())
        record_routing(self, call)  # what the trainer's losses read: every call since they were last taken
        self.aux = call.aux()  # this call's
        return out.reshape(shape)

    def __getstate__(self) -> dict:
        # The last call's losses hang on its autograd graph, which neither deepcopy nor pickle can copy.
        return {**super().__getstate__(), "aux": None}

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, capacity_factor={self.capacity_factor}, "
            f"ep_size={self.ep_size}" + (", replicated_experts=True" if self.replicated_experts else "")
        )


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every `MoELayer` inside `model`, in module order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]
