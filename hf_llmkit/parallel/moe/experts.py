"""Fused SwiGLU experts and their grouped forward/backward.

The weights use transformers' fused MoE layout (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`), so a
`FusedExperts` state dict is a Mixtral / Qwen2-MoE `experts` state dict. Rows arrive sorted by expert
(`counts[e]` consecutive rows for expert e).

How the work is laid out (each choice measured on CPU with benchmarks/moe.py):
- One `torch.mm` per expert on its own rows, written in place (`out=`): no padding to a common row count
  (a padded `[E, C, H]` batch for `bmm` pays for the padding rows, ~10% at 8 experts and up to 2x at 64)
  and no per-token weight copies.
- Rows go through in tiles of at most `ROW_TILE`: a tile's gate/up product, activation, gating product and
  down product run back to back, and so does its whole backward chain, so the `[rows, I]` intermediates are
  still in cache when the next op reads them. Over all `2 * tokens` rows at once the elementwise ops ran
  from memory and cost ~3x what they cost inside the dense MLP.
- Forward keeps what a dense MLP's autograd keeps (input, the gate and up pre-activations, the activation
  and the gated hidden), so backward recomputes nothing; a tile's weight gradients accumulate in place.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.activations import ACT2FN

ROW_TILE = 512  # rows per tile: [512, I] intermediates stay in cache; large enough for full-speed matmuls


def _tiles(counts: tuple[int, ...]) -> list[tuple[int, int, int, bool]]:
    """(expert, start, stop, first tile of its expert) for every tile of every non-empty expert."""
    out, start = [], 0
    for expert, n in enumerate(counts):
        for lo in range(start, start + n, ROW_TILE):
            out.append((expert, lo, min(lo + ROW_TILE, start + n), lo == start))
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
    """`y = down_e(act(gate_e x) * up_e x)` for rows of `x [N, H]` grouped by expert (`counts[e]` rows each)."""

    @staticmethod
    def forward(ctx, x, gate_up, down, counts: tuple[int, ...], act_name: str):
        tiles, inter = _tiles(counts), down.shape[-1]
        y = x.new_empty(x.shape)  # [N, H]
        saved = []  # per tile: pre-activations [n, 2I], act(gate) [n, I], act(gate) * up [n, I]
        for e, lo, hi, _ in tiles:
            # Separate tensors per tile, not slices of [N, 2I] buffers: allocations above glibc's mmap
            # threshold (32 MiB) are fresh pages every step, and faulting them in cost ~4% of the layer.
            h = torch.mm(x[lo:hi], gate_up[e].t())  # [n, 2I]: gate | up
            gate, up = h[:, :inter], h[:, inter:]
            act = torch.nn.functional.silu(gate) if act_name == "silu" else ACT2FN[act_name](gate)
            hidden = act * up
            torch.mm(hidden, down[e].t(), out=y[lo:hi])
            saved += (h, act, hidden)
        ctx.save_for_backward(x, gate_up, down, *saved)
        ctx.tiles, ctx.act_name = tiles, act_name
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate_up, down, *saved = ctx.saved_tensors
        inter, tiles = down.shape[-1], ctx.tiles
        need_x, need_gu, need_down = ctx.needs_input_grad[:3]
        dy = dy.contiguous()
        dx = torch.empty_like(x) if need_x else None
        d_gate_up = torch.empty_like(gate_up) if need_gu else None
        d_down = torch.empty_like(down) if need_down else None
        used = {e for e, *_ in tiles}
        for e in range(gate_up.shape[0]):
            if e not in used:  # an expert without rows gets a zero gradient
                for grad in (d_gate_up, d_down):
                    if grad is not None:
                        grad[e].zero_()
        for i, (e, lo, hi, first) in enumerate(tiles):
            h, act, hidden = saved[3 * i : 3 * i + 3]
            dy_t = dy[lo:hi]  # [n, H]
            if need_down:
                _mm_into(d_down[e], dy_t.t(), hidden, accumulate=not first)  # [H, I]
            if not (need_x or need_gu):
                continue
            gate, up = h[:, :inter], h[:, inter:]
            da = torch.mm(dy_t, down[e])  # [n, I]: d hidden
            dh = torch.empty_like(h)  # [n, 2I]: d gate | d up
            if ctx.act_name == "silu":
                torch.ops.aten.silu_backward.grad_input(da * up, gate, grad_input=dh[:, :inter])
            else:
                _, deriv = _act_and_grad(gate, ctx.act_name)
                torch.mul(da * up, deriv, out=dh[:, :inter])
            torch.mul(da, act, out=dh[:, inter:])
            if need_gu:
                _mm_into(d_gate_up[e], dh.t(), x[lo:hi], accumulate=not first)  # [2I, H]
            if need_x:
                torch.mm(dh, gate_up[e], out=dx[lo:hi])
        return dx, d_gate_up, d_down, None, None


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """`out = a @ b`, or `out += a @ b` when `accumulate`."""
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


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

    def forward(
        self, sorted_tokens: torch.Tensor, counts: list[int] | tuple[int, ...], *, first_expert: int = 0
    ) -> torch.Tensor:
        """Apply expert `first_expert + e` to the e-th segment of `sorted_tokens [N, H]` (`counts[e]` rows).

        `counts` covers every expert held here, or with `first_expert` a consecutive subset of them (the ones
        this rank computes when the weights are replicated over an expert-parallel group). Returns `[N, H]`.
        """
        rows, used = sorted_tokens.shape[0], len(counts)
        if sum(counts) != rows or first_expert < 0 or first_expert + used > self.num_experts:
            raise ValueError(
                f"counts {list(counts)} from expert {first_expert} do not split {rows} rows over "
                f"{self.num_experts} experts"
            )
        gate_up, down = self.gate_up_proj, self.down_proj
        if used != self.num_experts:
            gate_up, down = gate_up.narrow(0, first_expert, used), down.narrow(0, first_expert, used)
        return GroupedSwiGLU.apply(sorted_tokens, gate_up, down, tuple(counts), self.hidden_act)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, hidden_act={self.hidden_act!r}"
        )
