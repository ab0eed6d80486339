"""Row routing for `MoELayer`: local gather/scatter and the expert-parallel all-to-all dispatch and combine.

Local routing: `gather_rows` copies each token once per chosen expert into expert-sorted order and
`scatter_rows` puts expert outputs back into `[tokens * top_k]` slots. Their backwards are a scatter into
slots plus a sum over the k slots of a token, and a gather, so no `index_add` (a serial scatter-add on
CPU) runs in either direction.

Expert parallelism:
Each rank of an expert-parallel group holds `E / P` consecutive experts. A rank's routed rows, sorted by
global expert, are sent to the rank owning each expert (`all_to_all_single` with uneven splits, which gloo
and NCCL both support), regrouped there by local expert, and sent back after the expert MLP. The backward
of an all-to-all is the all-to-all with the splits swapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


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


class GatherRows(torch.autograd.Function):
    """`x[slots // k]`: the token behind each routed slot, for `x [T, H]` and `slots [N]` in `[0, T*k)`."""

    @staticmethod
    def forward(ctx, x, slots, k: int):
        ctx.save_for_backward(slots)
        ctx.num_tokens, ctx.k = x.shape[0], k
        return x.index_select(0, slots // k)

    @staticmethod
    def backward(ctx, grad):
        (slots,) = ctx.saved_tensors
        return scatter_rows(grad, slots, ctx.num_tokens * ctx.k).view(ctx.num_tokens, ctx.k, -1).sum(1), None, None


class ScatterRows(torch.autograd.Function):
    """Rows of `x [N, H]` written to `slots [N]` of a `[num_slots, H]` tensor whose other rows are zero."""

    @staticmethod
    def forward(ctx, x, slots, num_slots: int):
        ctx.save_for_backward(slots)
        if slots.numel() == num_slots:  # a permutation: every row is written
            out = x.new_empty(num_slots, *x.shape[1:])
        else:
            out = x.new_zeros(num_slots, *x.shape[1:])
        return out.index_copy_(0, slots, x)

    @staticmethod
    def backward(ctx, grad):
        (slots,) = ctx.saved_tensors
        return grad.index_select(0, slots), None, None


def scatter_rows(x: torch.Tensor, slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Differentiable `out = zeros(num_slots, H); out[slots] = x`."""
    return ScatterRows.apply(x, slots, num_slots)


def gather_rows(x: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
    """Differentiable `x[slots // k]` whose backward sums each token's k slots without a scatter-add."""
    return GatherRows.apply(x, slots, k)


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
