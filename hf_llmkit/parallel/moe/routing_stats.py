"""What the MoE blocks of a model routed since the losses were last taken: ours (`MoELayer`) and transformers' own.

Each routing call of a block adds to the block's record: the sum over tokens of the router probabilities `[E]`, the
tokens each expert got `[E]`, the sum over tokens of the router z-loss term, and the token / slot counts. The
auxiliary losses are computed from the sums when they are taken (`take_routing`), so a block called several times
in one forward -- the tiled MLP runs it once per chunk of positions -- gives exactly the losses of one call on all
its tokens (the balancing loss `E * sum_e f_e * P_e` is not a mean of per-chunk values).

`MoELayer` records its own calls. transformers' Mixtral / Qwen2-MoE sparse blocks run their own router; a forward
hook on it (`watch_native_routers`, installed by `LLMKitTrainer`) records its logits and chosen experts, so a model
that keeps transformers' blocks (`experts_implementation="llmkit"`, or any other) gets the same losses and logs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from hf_llmkit.compat.transformers import router_logits_and_experts

__all__ = ["RoutingRecord", "clear_routing", "moe_blocks", "record_routing", "take_routing", "watch_native_routers"]

_RECORDS: weakref.WeakKeyDictionary[nn.Module, RoutingRecord] = weakref.WeakKeyDictionary()
_WATCHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@dataclass
class RoutingRecord:
    """Sums over the routed tokens of one or more calls of a block (see the module docstring)."""

    prob_sum: torch.Tensor  # [E] sum over tokens of the router probabilities (differentiable)
    z_sum: torch.Tensor  # sum over tokens of logsumexp(logits)^2 (differentiable)
    load: torch.Tensor  # [E] tokens routed to each expert (before any capacity drop)
    tokens: int
    slots: int  # routed (token, expert) pairs
    kept: int  # pairs an expert computed (all of them when dropless)

    @classmethod
    def of_call(
        cls, logits: torch.Tensor, experts: torch.Tensor, *, probs: torch.Tensor | None = None, kept: int | None = None
    ) -> RoutingRecord:
        """The record of one call from its router `logits [T, E]` and chosen `experts [T, K]` (`probs`: the
        router's float32 softmax of the logits, when it has it; `kept`: pairs not dropped by a capacity limit)."""
        num_experts = logits.shape[-1]
        probs = torch.softmax(logits.float(), dim=-1) if probs is None else probs  # [T, E]
        load = torch.bincount(experts.reshape(-1).detach(), minlength=num_experts)  # [E]
        z = torch.logsumexp(logits.float(), dim=-1).square().sum()
        slots = experts.numel()
        return cls(probs.sum(0), z, load, logits.shape[0], slots, slots if kept is None else kept)

    def __add__(self, other: RoutingRecord) -> RoutingRecord:
        return RoutingRecord(
            self.prob_sum + other.prob_sum, self.z_sum + other.z_sum, self.load + other.load,
            self.tokens + other.tokens, self.slots + other.slots, self.kept + other.kept,
        )  # fmt: skip

    def aux(self):
        """The `MoEAux` of these tokens: Switch balancing loss, z-loss, expert load, dropped fraction."""
        from hf_llmkit.parallel.moe.layer import MoEAux

        tokens = max(self.tokens, 1)
        fraction = self.load.to(self.prob_sum.dtype) / tokens  # [E], sums to top_k
        balancing = self.prob_sum.shape[0] * torch.sum(fraction * self.prob_sum / tokens)
        dropped = 1.0 - self.kept / max(self.slots, 1)
        return MoEAux(balancing, self.z_sum / tokens, self.load.detach(), torch.tensor(dropped))


def record_routing(block: nn.Module, record: RoutingRecord) -> None:
    """Add one call of `block` to its record."""
    previous = _RECORDS.get(block)
    _RECORDS[block] = record if previous is None else previous + record


def take_routing(block: nn.Module):
    """The `MoEAux` of everything `block` routed since the last take (None when it did not run); clears it."""
    record = _RECORDS.pop(block, None)
    return None if record is None or record.tokens == 0 else record.aux()


def clear_routing(model: nn.Module) -> None:
    """Forget what the blocks of `model` recorded (e.g. recomputations in the last backward)."""
    for block in moe_blocks(model):
        _RECORDS.pop(block, None)


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """Every MoE block of `model`, in module order: `MoELayer`s and transformers' Mixtral / Qwen2-MoE sparse blocks."""
    from hf_llmkit.parallel.moe.layer import MoELayer
    from hf_llmkit.parallel.moe.upcycle import is_native_moe_block

    return [m for m in model.modules() if isinstance(m, MoELayer) or is_native_moe_block(m)]


def watch_native_routers(model: nn.Module) -> int:
    """Record the routing of every transformers sparse block of `model` (a forward hook on its router; installed
    once per block); returns how many blocks are watched."""
    from hf_llmkit.parallel.moe.upcycle import is_native_moe_block

    count = 0
    for block in model.modules():
        if not is_native_moe_block(block):
            continue
        count += 1
        if block not in _WATCHED:
            _WATCHED.add(block)
            block.gate.register_forward_hook(_router_hook(block))
    return count


def _router_hook(block: nn.Module):
    ref = weakref.ref(block)

    def hook(router: nn.Module, args, output) -> None:
        owner = ref()
        if owner is not None:
            logits, experts = router_logits_and_experts(output)
            record_routing(owner, RoutingRecord.of_call(logits, experts))

    return hook
