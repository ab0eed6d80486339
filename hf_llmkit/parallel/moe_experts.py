"""Fused SwiGLU experts and their grouped forward/backward.

The weights use transformers' fused MoE layout (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`), so a
`FusedExperts` state dict is a Mixtral / Qwen2-MoE `experts` state dict. Tokens arrive sorted by expert;
each expert's rows are one contiguous segment, multiplied with one `torch.mm` per expert written straight
into a preallocated buffer (no per-token work, no concatenation). The activation and its derivative run
once over all rows. The hand-written backward keeps only the input and the `[N, 2I]` pre-activation.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.activations import ACT2FN


def _segments(counts: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(expert, start, stop) for every non-empty segment."""
    out, start = [], 0
    for expert, n in enumerate(counts):
        if n:
            out.append((expert, start, start + n))
        start += n
    return out


def _act_and_grad(gate: torch.Tensor, act_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(gate) and act'(gate) through autograd, for activations other than SiLU."""
    with torch.enable_grad():
        g = gate.detach().requires_grad_(True)
        act = ACT2FN[act_name](g)
        (deriv,) = torch.autograd.grad(act, g, torch.ones_like(act))
    return act.detach(), deriv


class GroupedSwiGLU(torch.autograd.Function):
    """`y = down_e(act(gate_e x) * up_e x)` for rows of `x` grouped by expert (`counts[e]` rows each)."""

    @staticmethod
    def forward(ctx, x, gate_up, down, counts: tuple[int, ...], act_name: str):
        num_rows, inter = x.shape[0], down.shape[-1]
        segments = _segments(counts)
        h = x.new_empty(num_rows, 2 * inter)  # [N, 2I]
        for e, lo, hi in segments:
            torch.mm(x[lo:hi], gate_up[e].t(), out=h[lo:hi])
        gate, up = h[:, :inter], h[:, inter:]
        if act_name == "silu":
            a = torch.nn.functional.silu(gate) * up
        else:
            a = ACT2FN[act_name](gate) * up  # [N, I]
        y = x.new_empty(num_rows, down.shape[1])  # [N, H]
        for e, lo, hi in segments:
            torch.mm(a[lo:hi], down[e].t(), out=y[lo:hi])
        ctx.save_for_backward(x, gate_up, down, h)
        ctx.segments, ctx.act_name = segments, act_name
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate_up, down, h = ctx.saved_tensors
        segments, inter = ctx.segments, down.shape[-1]
        dy = dy.contiguous()
        need_x, need_gu, need_down = ctx.needs_input_grad[:3]
        gate, up = h[:, :inter], h[:, inter:]
        da = x.new_empty(x.shape[0], inter)  # [N, I]
        for e, lo, hi in segments:
            torch.mm(dy[lo:hi], down[e], out=da[lo:hi])
        dh = x.new_empty(h.shape)  # [N, 2I]: d gate | d up
        if ctx.act_name == "silu":
            act = torch.nn.functional.silu(gate)
            torch.ops.aten.silu_backward.grad_input(da * up, gate, grad_input=dh[:, :inter])
        else:
            act, dact = _act_and_grad(gate, ctx.act_name)
            torch.mul(da * up, dact, out=dh[:, :inter])
        torch.mul(da, act, out=dh[:, inter:])
        d_down = _empty_grad(down, segments) if need_down else None
        if need_down:
            a = act.mul_(up)  # act is not needed any more: reuse its buffer for the expert's hidden activation
            for e, lo, hi in segments:
                torch.mm(dy[lo:hi].t(), a[lo:hi], out=d_down[e])
        dx = x.new_zeros(x.shape) if need_x and not segments else (x.new_empty(x.shape) if need_x else None)
        d_gate_up = _empty_grad(gate_up, segments) if need_gu else None
        for e, lo, hi in segments:
            if need_gu:
                torch.mm(dh[lo:hi].t(), x[lo:hi], out=d_gate_up[e])
            if need_x:
                torch.mm(dh[lo:hi], gate_up[e], out=dx[lo:hi])
        return dx, d_gate_up, d_down, None, None


def _empty_grad(weight: torch.Tensor, segments: list[tuple[int, int, int]]) -> torch.Tensor:
    """A gradient buffer for `weight [E, ...]`: uninitialised, except zeros for experts that got no rows."""
    grad = torch.empty_like(weight)
    used = {e for e, _, _ in segments}
    for e in range(weight.shape[0]):
        if e not in used:
            grad[e].zero_()
    return grad


class FusedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs stored as two 3-D tensors (transformers' fused expert layout).

    Args:
        num_experts: experts held by this module (the local ones under expert parallelism).
        hidden_size: model width H.
        intermediate_size: expert width I.
        hidden_act: a `transformers.activations.ACT2FN` name; "silu" has a closed-form backward.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act={hidden_act!r} is not a transformers activation; use e.g. 'silu' or 'gelu'")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        factory = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **factory))
        nn.init.normal_(self.gate_up_proj, std=1.0 / math.sqrt(hidden_size))
        nn.init.normal_(self.down_proj, std=1.0 / math.sqrt(intermediate_size))

    @torch.no_grad()
    def keep_experts_(self, start: int, count: int) -> None:
        """Keep only experts `[start, start + count)` (this rank's shard under expert parallelism)."""
        self.gate_up_proj = nn.Parameter(self.gate_up_proj[start : start + count].clone())
        self.down_proj = nn.Parameter(self.down_proj[start : start + count].clone())
        self.num_experts = count

    def forward(self, sorted_tokens: torch.Tensor, counts: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Apply expert e to the e-th segment of `sorted_tokens [N, H]` (`counts[e]` rows); returns `[N, H]`."""
        if sum(counts) != sorted_tokens.shape[0] or len(counts) != self.num_experts:
            rows = sorted_tokens.shape[0]
            raise ValueError(f"counts {list(counts)} do not split {rows} rows over {self.num_experts} experts")
        return GroupedSwiGLU.apply(sorted_tokens, self.gate_up_proj, self.down_proj, tuple(counts), self.hidden_act)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, hidden_act={self.hidden_act!r}"
        )
