"""Fused SwiGLU experts and their grouped forward/backward.

The weights use transformers' fused MoE layout (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`), so a
`FusedExperts` state dict is a Mixtral / Qwen2-MoE `experts` state dict. Tokens arrive sorted by expert.
When the experts' row counts are close to each other (padding to the largest count adds at most
`MAX_PADDING` of extra rows) the rows are laid out as `[E, C, H]` and every product is one `torch.bmm`;
otherwise each expert's contiguous segment gets one `torch.mm` written into a preallocated buffer. Both
avoid per-token work; the batched form runs one parallel region per product instead of one per expert,
which on CPU (few cores, often shared) is up to twice as fast. The hand-written backward keeps only the
input and the pre-activation and computes the activation's derivative once over all rows.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.activations import ACT2FN

MAX_PADDING = 0.25  # batched layout when E * max(count) <= (1 + MAX_PADDING) * rows


def _segments(counts: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(expert, start, stop) for every non-empty segment."""
    out, start = [], 0
    for expert, n in enumerate(counts):
        if n:
            out.append((expert, start, start + n))
        start += n
    return out


def _padded_positions(counts: tuple[int, ...], capacity: int, device: torch.device) -> torch.Tensor:
    """Row `i` of the expert-sorted rows goes to row `pos[i]` of the `[E * capacity]` padded layout."""
    lens = torch.tensor(counts, device=device)
    starts = lens.cumsum(0) - lens
    expert = torch.repeat_interleave(torch.arange(len(counts), device=device), lens)
    return torch.arange(int(lens.sum()), device=device) - starts[expert] + expert * capacity


class _Layout:
    """Expert-grouped rows: `[N, K]` segments (`mm` per expert) or a padded `[E, C, K]` batch (`bmm`)."""

    def __init__(self, counts: tuple[int, ...], device: torch.device):
        self.counts, self.segments = counts, _segments(counts)
        rows, capacity = sum(counts), max(counts, default=0)
        self.batched = rows > 0 and len(counts) * capacity <= (1 + MAX_PADDING) * rows
        self.capacity = capacity
        exact = self.batched and len(counts) * capacity == rows
        self.pos = _padded_positions(counts, capacity, device) if self.batched and not exact else None

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        """`[N, K]` sorted rows -> this layout (zero rows as padding)."""
        if not self.batched:
            return rows
        if self.pos is None:
            return rows.view(len(self.counts), self.capacity, -1)
        out = rows.new_zeros(len(self.counts) * self.capacity, rows.shape[-1])
        return out.index_copy_(0, self.pos, rows).view(len(self.counts), self.capacity, -1)

    def unpack(self, grouped: torch.Tensor) -> torch.Tensor:
        """This layout -> `[N, K]` sorted rows."""
        if not self.batched:
            return grouped
        flat = grouped.reshape(-1, grouped.shape[-1])
        return flat if self.pos is None else flat.index_select(0, self.pos)

    def matmul(self, a: torch.Tensor, w: torch.Tensor, *, transpose: bool) -> torch.Tensor:
        """Per expert e: `a_e @ w_e.T` (transpose) or `a_e @ w_e`."""
        w = w.transpose(1, 2) if transpose else w
        if self.batched:
            return torch.bmm(a, w)
        out = a.new_empty(a.shape[0], w.shape[2])
        for e, lo, hi in self.segments:
            torch.mm(a[lo:hi], w[e], out=out[lo:hi])
        return out

    def weight_grad(self, d_out: torch.Tensor, inp: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Per expert e: `d_out_e.T @ inp_e`, shaped like the weight `like [E, ., .]`."""
        if self.batched:
            return torch.bmm(d_out.transpose(1, 2), inp)
        grad = torch.empty_like(like)
        used = {e for e, _, _ in self.segments}
        for e in range(like.shape[0]):
            if e not in used:  # an expert without rows gets a zero gradient
                grad[e].zero_()
        for e, lo, hi in self.segments:
            torch.mm(d_out[lo:hi].t(), inp[lo:hi], out=grad[e])
        return grad


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
        layout = _Layout(counts, x.device)
        inter = down.shape[-1]
        xg = layout.pack(x)  # [N, H] or [E, C, H]
        h = layout.matmul(xg, gate_up, transpose=True)  # [..., 2I]
        gate, up = h[..., :inter], h[..., inter:]
        act = torch.nn.functional.silu(gate) if act_name == "silu" else ACT2FN[act_name](gate)
        y = layout.matmul(act.mul_(up), down, transpose=True)  # [..., H]
        ctx.save_for_backward(xg, gate_up, down, h)
        ctx.layout, ctx.act_name = layout, act_name
        return layout.unpack(y)

    @staticmethod
    def backward(ctx, dy):
        xg, gate_up, down, h = ctx.saved_tensors
        layout, inter = ctx.layout, down.shape[-1]
        need_x, need_gu, need_down = ctx.needs_input_grad[:3]
        dyg = layout.pack(dy.contiguous())
        gate, up = h[..., :inter], h[..., inter:]
        da = layout.matmul(dyg, down, transpose=False)  # [..., I]
        dh = torch.empty_like(h)  # [..., 2I]: d gate | d up
        if ctx.act_name == "silu":
            act = torch.nn.functional.silu(gate)
            torch.ops.aten.silu_backward.grad_input(da * up, gate, grad_input=dh[..., :inter])
        else:
            act, dact = _act_and_grad(gate, ctx.act_name)
            torch.mul(da * up, dact, out=dh[..., :inter])
        torch.mul(da, act, out=dh[..., inter:])
        d_down = layout.weight_grad(dyg, act.mul_(up), down) if need_down else None  # act * up: expert hidden
        d_gate_up = layout.weight_grad(dh, xg, gate_up) if need_gu else None
        dx = None
        if need_x:
            dx = (
                layout.unpack(layout.matmul(dh, gate_up, transpose=False))
                if layout.segments
                else xg.new_zeros(dy.shape)
            )
        return dx, d_gate_up, d_down, None, None


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
