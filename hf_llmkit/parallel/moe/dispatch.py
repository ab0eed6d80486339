"""Row routing for `MoELayer`: local gather/scatter and the expert-parallel all-to-all dispatch and combine.

Local routing: `tokens_to_rows` copies each token once per chosen expert into expert-sorted order and
`rows_to_tokens` gathers each token's expert outputs back and sums them weighted by the router. Both
directions of both are row gathers (`index_select`) through `order` (row -> slot) and its inverse `pos`
(slot -> row), so no `index_add` (a serial scatter-add on CPU) and no zero-filled scatter buffer is used.
On float32 CPU tensors the combine (both directions) and the gather's backward run in `_routing_native.c` (built
once per machine, `hf_llmkit.native.CLibrary`): one pass each, with no `[T, K, H]` per-slot copy; elsewhere (GPUs,
bfloat16, a machine without a C compiler) torch's ops above serve.

Expert parallelism:
Each rank of an expert-parallel group holds `E / P` consecutive experts. A rank's routed rows, sorted by
global expert, are sent to the rank owning each expert (`all_to_all_single` with uneven splits, which gloo
and NCCL both support), regrouped there by local expert, and sent back after the expert MLP. The backward
of an all-to-all is the all-to-all with the splits swapped.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hf_llmkit.native import I64, INT, CLibrary, P


def _declare(lib: ctypes.CDLL) -> None:
    lib.routing_combine_forward.argtypes = [P, P, P, I64, I64, I64, I64, P, INT]
    lib.routing_combine_backward.argtypes = [P, P, P, P, I64, I64, I64, I64, P, P, INT]
    lib.routing_gather_backward.argtypes = [P, P, I64, I64, I64, I64, P, INT]
    for fn in (lib.routing_combine_forward, lib.routing_combine_backward, lib.routing_gather_backward):
        fn.restype = None


_KERNEL = CLibrary(
    Path(__file__).with_name("_routing_native.c"), "moe_routing", "The MoE routing CPU kernel",
    "routing uses torch ops", _declare,
)  # fmt: skip


def kernel_serves(pos: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether `_routing_native.c` takes these tensors: `pos` int64 and the rest float32, all on the CPU (and the
    kernel built)."""
    on_cpu = all(t.device.type == "cpu" for t in (pos, *tensors))
    typed = pos.dtype == torch.int64 and all(t.dtype == torch.float32 for t in tensors)
    return on_cpu and typed and _KERNEL.library() is not None


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` on rows of a 2-D tensor, differentiable (backward swaps the splits)."""

    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return AllToAll.apply(grad.contiguous(), input_splits, output_splits, ctx.group), None, None, None


class Permute(torch.autograd.Function):
    """Rows `x[perm]` for a permutation `perm`; backward is the inverse permutation (no scatter-add)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class TokensToRows(torch.autograd.Function):
    """Copy each token once per routed slot, in expert-sorted order: `rows[i] = x[order[i] // k]`.

    Backward sums each token's k row gradients through the inverse map `pos` (slot -> row; dropped slots
    point past the last row and read zero), so no serial scatter-add (`index_add`) runs (in one C pass where the
    routing kernel serves).
    """

    @staticmethod
    def forward(ctx, x, order, pos, k: int):
        ctx.save_for_backward(pos)
        ctx.num_tokens, ctx.k, ctx.dropped = x.shape[0], k, order.numel() < pos.numel()
        return x.index_select(0, order // k)  # [N, H]

    @staticmethod
    def backward(ctx, d_rows):
        (pos,) = ctx.saved_tensors
        if kernel_serves(pos, d_rows):
            pos, d_rows = pos.contiguous(), d_rows.contiguous()
            tokens, k, hidden = ctx.num_tokens, ctx.k, d_rows.shape[1]
            d_x = d_rows.new_empty(tokens, hidden)
            _KERNEL.library().routing_gather_backward(
                d_rows.data_ptr(), pos.data_ptr(), tokens, k, hidden, d_rows.shape[0], d_x.data_ptr(),
                torch.get_num_threads(),
            )  # fmt: skip
            return d_x, None, None, None
        if ctx.dropped:
            d_rows = torch.cat([d_rows, d_rows.new_zeros(1, d_rows.shape[1])])
        per_slot = d_rows.index_select(0, pos).view(ctx.num_tokens, ctx.k, -1)  # [T, K, H]
        d_x = per_slot[:, 0] + per_slot[:, 1] if ctx.k == 2 else per_slot.sum(1)  # top-2: one pass, not a reduction
        return d_x, None, None, None


class RowsToTokens(torch.autograd.Function):
    """Weighted sum of each token's expert outputs: `out[t] = sum_k weights[t, k] * rows[pos[t * k + j]]`.

    `pos [T*K]` maps each (token, slot) to its row of `rows [N, H]` (N = T*K dropless; a dropped slot points at
    row N, read as zero). On torch's ops forward and backward are row gathers (`index_select`) plus one product
    each; the C kernel does each in one pass and keeps `rows` itself for backward instead of a `[T, K, H]` copy.
    """

    @staticmethod
    def forward(ctx, rows, weights, order, pos):
        num_tokens, k = weights.shape
        ctx.kernel = kernel_serves(pos, rows, weights)
        if ctx.kernel:  # rows are kept as they are (the experts' output): backward reads them through pos
            rows, weights, pos = rows.contiguous(), weights.contiguous(), pos.contiguous()
            out = rows.new_empty(num_tokens, rows.shape[1])
            _KERNEL.library().routing_combine_forward(
                rows.data_ptr(), weights.data_ptr(), pos.data_ptr(), num_tokens, k, rows.shape[1], rows.shape[0],
                out.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
            ctx.save_for_backward(rows, weights, pos)
            return out
        if order.numel() < pos.numel():
            rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        per_slot = rows.index_select(0, pos).view(num_tokens, k, -1)  # [T, K, H]
        ctx.save_for_backward(per_slot, weights, order)
        return torch.bmm(weights.unsqueeze(1), per_slot).squeeze(1)  # [T, H]

    @staticmethod
    def backward(ctx, d_out):
        if ctx.kernel:
            rows, weights, pos = ctx.saved_tensors
            d_out, (tokens, k), hidden = d_out.contiguous(), weights.shape, rows.shape[1]
            d_rows, d_weights = torch.empty_like(rows), torch.empty_like(weights)
            _KERNEL.library().routing_combine_backward(
                rows.data_ptr(), weights.data_ptr(), pos.data_ptr(), d_out.data_ptr(), tokens, k, hidden,
                rows.shape[0], d_rows.data_ptr(), d_weights.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
            return d_rows, d_weights, None, None
        per_slot, weights, order = ctx.saved_tensors
        d_rows = d_weights = None
        if ctx.needs_input_grad[0]:
            d_slots = weights.unsqueeze(-1) * d_out.unsqueeze(1)  # [T, K, H]
            d_rows = d_slots.view(-1, d_slots.shape[-1]).index_select(0, order)  # [N, H]
        if ctx.needs_input_grad[1]:  # a row-wise dot product; bmm with [H, 1] blocks is ~5x slower on CPU
            d_weights = torch.linalg.vecdot(per_slot, d_out.unsqueeze(1))  # [T, K]
        return d_rows, d_weights, None, None


def slot_positions(order: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Inverse of `order` (row -> slot) as slot -> row `[num_slots]`; slots not in `order` map to `len(order)`."""
    pos = torch.full((num_slots,), order.numel(), dtype=order.dtype, device=order.device)
    return pos.index_copy_(0, order, torch.arange(order.numel(), dtype=order.dtype, device=order.device))


def tokens_to_rows(x: torch.Tensor, order: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """Differentiable `x[order // k]`: `x [T, H]` -> expert-sorted rows `[N, H]`."""
    return TokensToRows.apply(x, order, pos, k)


def rows_to_tokens(rows: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Differentiable weighted combine of expert-sorted `rows [N, H]` into tokens `[T, H]` (`weights [T, K]`)."""
    return RowsToTokens.apply(rows, weights, order, pos)


@dataclass
class DispatchPlan:
    """What `combine` needs to send rows back: the regrouping permutation and the all-to-all splits."""

    perm: torch.Tensor
    inverse: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]


def dispatch(
    rows: torch.Tensor, counts: torch.Tensor, *, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, list[int], DispatchPlan]:
    """Send `rows [N, H]` (sorted by global expert, `counts [E]` per expert) to the experts' owners.

    Returns this rank's received rows sorted by local expert, the row count per local expert, and the plan
    for `combine`.
    """
    world = dist.get_world_size(group)
    num_local = counts.numel() // world
    send = counts.to(torch.int64).view(world, num_local)  # [P, E/P]: rows for rank r's experts
    recv = torch.empty_like(send)  # [P, E/P]: rows from source s for local expert e
    dist.all_to_all_single(recv.view(-1), send.reshape(-1).contiguous(), group=group)
    send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    received = AllToAll.apply(rows, recv_splits, send_splits, group)  # [M, H], source-major
    # Regroup source-major blocks (s, e) into expert-major order (e, s).
    starts = (recv.reshape(-1).cumsum(0) - recv.reshape(-1)).view(world, num_local)
    block_starts, block_lens = starts.t().reshape(-1), recv.t().reshape(-1)  # expert-major
    total = int(block_lens.sum())
    offsets = torch.arange(total) - torch.repeat_interleave(block_lens.cumsum(0) - block_lens, block_lens)
    perm = torch.repeat_interleave(block_starts, block_lens) + offsets
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(total)
    local_rows = Permute.apply(received, perm, inverse)
    plan = DispatchPlan(perm=perm, inverse=inverse, send_splits=send_splits, recv_splits=recv_splits)
    return local_rows, recv.sum(0).tolist(), plan


def combine(local_out: torch.Tensor, plan: DispatchPlan, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send expert outputs back to the ranks their rows came from, in the order `dispatch` received them."""
    source_major = Permute.apply(local_out, plan.inverse, plan.perm)
    return AllToAll.apply(source_major, plan.send_splits, plan.recv_splits, group)
