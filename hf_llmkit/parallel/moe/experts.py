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
  still in cache (L2 / L3) when the next op reads them. Over all `2 * tokens` rows at once the elementwise ops
  ran from memory and cost ~3x what they cost inside the dense MLP. 2,048 rows keeps most experts in one tile
  (a second tile re-reads and re-writes the expert's weight gradient); at 2 threads it was 4-8% faster than
  512 at 8 experts, and equal at 1 thread. An expert's rows are cut into equal tiles (no sliver of a few rows,
  whose matmuls run far below speed).
- Experts are not batched into padded `bmm` groups on several threads: measured at 2 threads it was within
  +-3% of one `mm` per expert, better at 8,192 tokens and worse at 64 experts and at 512 tokens.
- Weight gradients go to reused memory (`GradientBuffer`): a fresh `[E, ., .]` gradient each step faulted in
  new pages, ~13% of the layer at 64 experts.
- Forward keeps what a dense MLP's autograd keeps (input, the gate and up pre-activations, the activation
  and the gated hidden), so backward recomputes no matmul; a tile's weight gradients are written in place.
- SwiGLU's elementwise work on float32 CPU tiles runs in one C pass each way (`swiglu_kernel`; torch's two ops
  forward and three backward each streamed a `[rows, I]` tensor from memory), and its backward recomputes the
  activation and the gated hidden from the pre-activations, so such a tile keeps only its input and `[gate | up]`.
  `benchmarks/moe.py` times the layer without it (`TORCH_OPS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import ACT2FN

from hf_llmkit.parallel.moe import swiglu_kernel
from hf_llmkit.parallel.moe.grad_buffers import GradientBuffer

ROW_TILE = 2048  # rows per tile at most: its [rows, 2I] intermediates stay in the last-level cache


@dataclass(frozen=True)
class _Tile:
    """Rows `[lo, hi)` of expert `expert`; `first` marks the expert's first tile (its weight gradients are written
    there and accumulated by the later tiles)."""

    expert: int
    lo: int
    hi: int
    first: bool = True

    def matmul(self, a: torch.Tensor, w: torch.Tensor, *, transpose: bool, out: torch.Tensor | None = None):
        """`a @ w_e.T` (transpose) or `a @ w_e` with this tile's expert weights `w_e = w[expert]`."""
        w_e = w[self.expert].t() if transpose else w[self.expert]
        return torch.mm(a, w_e) if out is None else torch.mm(a, w_e, out=out[self.lo : self.hi])

    def weight_grad_into(self, grad: torch.Tensor, d_out: torch.Tensor, inp: torch.Tensor) -> None:
        """This tile's share of `grad[e] = d_out_e.T @ inp_e`."""
        if self.first:
            torch.mm(d_out.t(), inp, out=grad[self.expert])
        else:
            grad[self.expert].addmm_(d_out.t(), inp)


def _tiles(counts: tuple[int, ...]) -> list[_Tile]:
    """Each expert's rows in `ceil(rows / ROW_TILE)` tiles of equal size (530 rows: 265 + 265, not 512 + 18: a
    sliver of a tile runs its matmuls at a fraction of full speed)."""
    tiles, start = [], 0
    for expert, n in enumerate(counts):
        pieces = max(-(-n // ROW_TILE), 1)
        bounds = [start + n * i // pieces for i in range(pieces + 1)]
        tiles += [_Tile(expert, lo, hi, i == 0) for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])) if hi > lo]
        start += n
    return tiles


def _act_and_grad(gate: torch.Tensor, act_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(gate) and act'(gate) through autograd, for activations other than SiLU."""
    with torch.enable_grad():
        g = gate.detach().requires_grad_(True)
        act = ACT2FN[act_name](g)
        (deriv,) = torch.autograd.grad(act, g, torch.ones_like(act))
    return act.detach(), deriv


def _forward_tile(tile: _Tile, x_t, gate_up, down, act_name: str, out: torch.Tensor | None = None):
    """One tile's `down_e(act(gate_e x_t) * up_e x_t)` (into `out[lo:hi]` when given) and what its backward keeps:
    the input rows, the pre-activations `[rows, 2I]`, act(gate) and act(gate) * up `[rows, I]` (these two None
    where the C kernel serves: its backward recomputes them)."""
    inter = down.shape[-1]
    h = tile.matmul(x_t, gate_up, transpose=True)  # [rows, 2I]: gate | up
    if act_name == "silu" and swiglu_kernel.serves(h):  # backward recomputes act and hidden from h in the kernel
        return tile.matmul(swiglu_kernel.forward(h), down, transpose=True, out=out), (x_t, h, None, None)
    gate, up = h[:, :inter], h[:, inter:]
    act = torch.nn.functional.silu(gate) if act_name == "silu" else ACT2FN[act_name](gate)
    hidden = act * up
    return tile.matmul(hidden, down, transpose=True, out=out), (x_t, h, act, hidden)  # [rows, H]


def _backward_tile(tile: _Tile, dy_t, saved, gate_up, down, act_name: str, grads, need_x: bool, dx=None):
    """One tile's backward from `dy_t [rows, H]`: adds its share of the weight gradients `grads` (gate_up's and
    down's, None where not needed) and returns its input rows' gradient (into `dx[lo:hi]` when given)."""
    x_t, h, act, hidden = saved
    d_gate_up, d_down = grads
    inter = down.shape[-1]
    dh = None
    if hidden is None:  # the C kernel's forward kept only h; its backward gives dh and the hidden rows again
        dh, hidden = swiglu_kernel.backward(h, tile.matmul(dy_t, down, transpose=False))
    if d_down is not None:
        tile.weight_grad_into(d_down, dy_t, hidden)  # [H, I] per expert
    if not (need_x or d_gate_up is not None):
        return None
    if dh is None:
        da = tile.matmul(dy_t, down, transpose=False)  # [rows, I]: d hidden
        gate, up = h[:, :inter], h[:, inter:]
        dh = torch.empty_like(h)
        if act_name == "silu":
            torch.ops.aten.silu_backward.grad_input(da * up, gate, grad_input=dh[:, :inter])
        else:
            _, deriv = _act_and_grad(gate, act_name)
            torch.mul(da * up, deriv, out=dh[:, :inter])
        torch.mul(da, act, out=dh[:, inter:])
    if d_gate_up is not None:
        tile.weight_grad_into(d_gate_up, dh, x_t)  # [2I, H] per expert
    return tile.matmul(dh, gate_up, transpose=False, out=dx) if need_x else None


class GroupedSwiGLU(torch.autograd.Function):
    """`y = down_e(act(gate_e x) * up_e x)` for rows of `x [N, H]` grouped by expert (`counts[e]` rows each)."""

    @staticmethod
    def forward(ctx, x, gate_up, down, counts: tuple[int, ...], act_name: str, buffers: tuple[GradientBuffer, ...]):
        tiles = _tiles(counts)
        y = x.new_empty(x.shape)  # [N, H]
        saved = []  # per tile: separate tensors, not slices of [N, 2I] buffers: allocations above glibc's mmap
        # threshold (32 MiB) are fresh pages every step, and faulting them in cost ~4% of the layer.
        for tile in tiles:
            saved += _forward_tile(tile, x[tile.lo : tile.hi], gate_up, down, act_name, out=y)[1]
        ctx.save_for_backward(gate_up, down, *saved)
        ctx.tiles, ctx.act_name, ctx.buffers = tiles, act_name, buffers
        return y

    @staticmethod
    def backward(ctx, dy):
        gate_up, down, *saved = ctx.saved_tensors
        need_x, need_gu, need_down = ctx.needs_input_grad[:3]
        dy = dy.contiguous()
        dx = dy.new_empty(dy.shape) if need_x else None
        grads = (
            ctx.buffers[0].empty_like(gate_up) if need_gu else None,
            ctx.buffers[1].empty_like(down) if need_down else None,
        )
        used = {t.expert for t in ctx.tiles}
        for e in range(gate_up.shape[0]):
            if e not in used:  # an expert without rows gets a zero gradient
                for grad in grads:
                    if grad is not None:
                        grad[e].zero_()
        for i, tile in enumerate(ctx.tiles):
            dy_t = dy[tile.lo : tile.hi]
            _backward_tile(tile, dy_t, saved[4 * i : 4 * i + 4], gate_up, down, ctx.act_name, grads, need_x, dx)
        return dx, *grads, None, None, None


def grouped_swiglu(
    rows: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: list[int] | tuple[int, ...],
    act_name: str,
    buffers: tuple[GradientBuffer, GradientBuffer],
) -> torch.Tensor:
    """`down_e(act(gate_e x) * up_e x)` for expert-sorted `rows [N, H]` (`counts[e]` rows for expert e of
    `gate_up [E, 2I, H]` / `down [E, H, I]`); `buffers` hold the weight gradients' memory between steps."""
    device = rows.device.type
    if not torch.is_autocast_enabled(device):
        return GroupedSwiGLU.apply(rows, gate_up, down, tuple(counts), act_name, buffers)
    # Under autocast the experts run like autocast runs a Linear: inputs and weights cast to the autocast dtype
    # (the casts' backward brings the weight gradients back to the weights' dtype), matmuls in that dtype.
    dtype = torch.get_autocast_dtype(device)
    args = (rows.to(dtype), gate_up.to(dtype), down.to(dtype))
    with torch.autocast(device, enabled=False):
        return GroupedSwiGLU.apply(*args, tuple(counts), act_name, buffers)


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
        self._grad_buffers = (GradientBuffer(), GradientBuffer())  # gate_up_proj's and down_proj's (CPU only)

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
        return grouped_swiglu(sorted_tokens, gate_up, down, counts, self.hidden_act, self._grad_buffers)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, hidden_act={self.hidden_act!r}"
        )
