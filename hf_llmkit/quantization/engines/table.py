"""eDKM (Cho et al., 2023): DKM's attention map computed over a table of unique weights, optionally sharded.

16-bit weights hold at most 65,536 distinct values, so the `[n, K]` attention of naive DKM collapses to a
`[U, K]` table over the unique values (weighted by how often each occurs) plus an inverse index. For a single
table of 16-bit scalars the inverse index *is* the weight's bit pattern, so nothing weight-sized is stored for
backward at all. The table can further be split across the ranks of a process group: each rank computes the
attention of its slice, the k-means sums are all-reduced and the result is all-gathered, all differentiably.

Gradients are exact (equal to naive DKM's): the centroid path flows through the table (the member weights of a
unique value share it equally) and the local path `d(A(w) C)/dw` is applied per weight with the closed-form
Jacobian of each unique value.

The shard group is made once per process when a model is quantized with `shard=True` (`make_shard_group`, called
as the DKM layers are built: every rank quantizes, so every rank takes part in `new_group`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.nn import functional as dist_nn

from hf_llmkit.quantization._dkm import DIST_EPS, autocast_off

_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHARD_GROUPS: dict[int, object] = {}  # world size -> the group of all ranks


def make_shard_group():
    """The process group eDKM shards the table over: all ranks, a group of its own (kept apart from DDP's gradient
    buckets), made once per process; None on a single process.

    Raises a ValueError when the process is one of several (WORLD_SIZE > 1) but torch.distributed is not initialised
    yet: the group must exist before training, and creating it later (in a forward) deadlocks when ranks differ.
    """
    if not (dist.is_available() and dist.is_initialized()):
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world > 1:
            raise ValueError(
                f"DKMConfig(shard=True) on one of {world} processes, but torch.distributed is not initialised: "
                "create the TrainingArguments / Accelerator (or call init_process_group) before loading the model, "
                "or set shard=False."
            )
        return None
    world = dist.get_world_size()
    if world == 1:
        return None
    if world not in _SHARD_GROUPS:
        _SHARD_GROUPS[world] = dist.new_group(ranks=list(range(world)))
    return _SHARD_GROUPS[world]


@dataclass
class WeightTable:
    """Unique weight vectors of a `[rows, cols]` weight in `G` groups of `n` vectors of length `d`.

    `mode` says how the inverse index (vector -> table row) is obtained: "direct" from the 16-bit pattern of
    the weight itself, "inverse" from the stored `inverse` (int32), "identity" (no uniquification: one row per
    vector).
    """

    values: torch.Tensor  # [U, d] float32
    gid: torch.Tensor  # [U] int64, group of each row
    counts: torch.Tensor  # [U] float32, member vectors of each row
    inverse: torch.Tensor  # int32: [N] rows ("inverse"), [G * 65536] pattern -> row ("direct"), empty
    mode: str
    groups: int
    cluster_dim: int


def _bit_pattern(weight: torch.Tensor) -> torch.Tensor:
    """Unsigned bit pattern of every element as int64 (a 16/32-bit float viewed as an integer)."""
    width = weight.element_size() * 8
    bits = weight.contiguous().view(_INT_OF_SIZE[weight.element_size()]).long()
    return bits & ((1 << width) - 1) if width < 64 else bits


def row_index(weight: torch.Tensor | None, inverse: torch.Tensor, mode: str, groups: int, n_vec: int) -> torch.Tensor:
    """Inverse index `[N]` (int32 where it can): the table row of every weight vector.

    `weight` is only read in "direct" mode, where the index is the weight's own 16-bit pattern (+ group offset)
    mapped to its row: 4 bytes per weight, temporary, instead of a stored int64 index.
    """
    if mode == "identity":
        return torch.arange(n_vec, device=inverse.device)
    if mode == "inverse":
        return inverse
    bits = weight.contiguous().view(torch.uint16).reshape(-1).to(torch.int32)
    if groups > 1:
        bits += (torch.arange(n_vec, device=weight.device, dtype=torch.int32) // (n_vec // groups)) * 65536
    # "direct": `inverse` maps each of the G * 65536 bit patterns to its row (absent patterns have none).
    return inverse.index_select(0, bits) if inverse.numel() else bits


def gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`table[idx]` for a `[U, d]` table (1-D gathers for d == 1: several times faster on CPU)."""
    if table.shape[1] == 1:
        return table[:, 0].index_select(0, idx).unsqueeze(1)
    return table.index_select(0, idx)


def _matmul_16bit_safe(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b`; 16-bit operands on CPU multiply in float32 (some CPUs' bf16 GEMM kernels run 50x slower)."""
    if a.device.type == "cpu" and a.dtype in (torch.bfloat16, torch.float16):
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b


def table_index(weight: torch.Tensor, table: WeightTable) -> torch.Tensor:
    """Inverse index `[N]` of `weight` into `table`."""
    n_vec = weight.numel() // table.cluster_dim
    return row_index(weight, table.inverse, table.mode, table.groups, n_vec)


@torch.no_grad()
def build_table(weight: torch.Tensor, groups: int, cluster_dim: int, uniquify: bool = True) -> WeightTable:
    """The (unique) weight table of `weight` (detached), with member counts and the way back to every vector."""
    d = cluster_dim
    vec = weight.detach().reshape(-1, d)  # [N, d]
    n_vec, per_group = vec.shape[0], vec.shape[0] // groups
    device = weight.device
    group_of = torch.arange(n_vec, device=device) // per_group if groups > 1 else torch.zeros(1, device=device).long()
    group_of = group_of.expand(n_vec)
    if not uniquify or weight.element_size() > 2:
        # Wider floats are (almost) all distinct: a unique table would be as large as the weight, plus a sort.
        ones = torch.ones(n_vec, device=device)
        return WeightTable(vec.float(), group_of, ones, vec.new_empty(0, dtype=torch.int32), "identity", groups, d)
    if weight.dtype in (torch.bfloat16, torch.float16) and d == 1 and groups * 65536 <= n_vec:
        # The bit pattern is the key: a bincount over the G * 65536 patterns replaces sorting the weight.
        patterns = torch.arange(65536, device=device, dtype=torch.int32).to(torch.int16).view(weight.dtype)
        empty = vec.new_empty(0, dtype=torch.int32)
        key = table_index(weight, WeightTable(vec, group_of, vec, empty, "direct", groups, d))
        counts = torch.bincount(key.long(), minlength=groups * 65536)
        present = counts.nonzero().squeeze(-1)  # [U]
        row_of = torch.full((groups * 65536,), -1, dtype=torch.int32, device=device)
        row_of[present] = torch.arange(present.numel(), dtype=torch.int32, device=device)
        values = patterns.float().repeat(groups)[present].unsqueeze(-1)
        return WeightTable(values, present // 65536, counts[present].float(), row_of, "direct", groups, d)
    if d <= 2:  # 16-bit patterns of up to two values and the group fit one int64 key: a 1-D unique
        bits = _bit_pattern(vec)
        key = (group_of << 32) | (bits[:, 0] << 16) | (bits[:, 1] if d == 2 else 0)
        uniq, inverse, counts = torch.unique(key, return_inverse=True, return_counts=True)
        gid = uniq >> 32
    else:
        rows = torch.cat([group_of.unsqueeze(-1), _bit_pattern(vec)], dim=1)  # [N, 1 + d]
        uniq, inverse, counts = torch.unique(rows, dim=0, return_inverse=True, return_counts=True)
        gid = uniq[:, 0]
    values = vec.new_zeros(uniq.shape[0], d, dtype=torch.float32).index_copy_(0, inverse, vec.float())
    return WeightTable(values, gid, counts.float(), inverse.to(torch.int32), "inverse", groups, d)


def table_std(table: WeightTable) -> torch.Tensor:
    """Population standard deviation `[G]` of each group's weights, from the table (equals the dense one)."""
    w = table.counts.unsqueeze(-1).expand_as(table.values)
    g = table.gid.unsqueeze(-1).expand_as(table.values).reshape(-1)
    tot = torch.zeros(table.groups, device=g.device).index_add_(0, g, w.reshape(-1))
    mean = torch.zeros_like(tot).index_add_(0, g, (w * table.values).reshape(-1)) / tot
    dev = (table.values - mean[table.gid].unsqueeze(-1)).square()
    var = torch.zeros_like(tot).index_add_(0, g, (w * dev).reshape(-1)) / tot
    return var.sqrt().clamp_min(1e-12)


class TableValues(torch.autograd.Function):
    """The table rows `[U, d]` as a differentiable function of the weight: a member's gradient is its share."""

    @staticmethod
    def forward(ctx, weight, values, counts, inverse, mode, groups, cluster_dim):
        ctx.meta = (mode, groups, weight.numel() // cluster_dim, weight.shape, weight.dtype)
        # Nothing weight-sized is kept: "direct" re-reads the bit patterns of the weight (a parameter, resident
        # anyway) through a 65,536-entry map; only "inverse" (non-16-bit weights) keeps an int32 index.
        ctx.save_for_backward(weight if mode == "direct" else None, counts, inverse)
        return values.clone()

    @staticmethod
    def backward(ctx, grad_values):
        weight, counts, inverse = ctx.saved_tensors
        mode, groups, n_vec, shape, dtype = ctx.meta
        share = grad_values / counts.clamp_min(1).unsqueeze(-1)
        if mode != "identity":
            share = gather_rows(share, row_index(weight, inverse, mode, groups, n_vec))
        return share.reshape(shape).to(dtype), None, None, None, None, None, None


class PaletteApply(torch.autograd.Function):
    """`x @ W_c^T` (or `W_c` itself when `x` is None) with `W_c` = table outputs gathered by the inverse index.

    `W_c` is rebuilt in backward instead of being saved (it is weight-sized); the gradient reaches the table
    outputs (centroid path) by an index-add and each weight through its row's local Jacobian.
    """

    @staticmethod
    def forward(ctx, x, out_values, jacobian, weight, inverse, mode, groups, cluster_dim):
        n_vec = weight.numel() // cluster_dim
        idx = row_index(weight, inverse, mode, groups, n_vec)
        ctx.meta = (mode, groups, cluster_dim, n_vec)
        ctx.save_for_backward(x, out_values, jacobian, weight, inverse)
        if x is None:
            return gather_rows(out_values.to(weight.dtype), idx).reshape(weight.shape)
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):  # see _matmul_16bit_safe
            w_c = gather_rows(out_values.to(x.dtype).float(), idx).reshape(weight.shape)
            return (x.float() @ w_c.t()).to(x.dtype)
        return x @ gather_rows(out_values.to(x.dtype), idx).reshape(weight.shape).t()

    @staticmethod
    @autocast_off
    def backward(ctx, grad):
        x, out_values, jacobian, weight, inverse = ctx.saved_tensors
        mode, groups, d, n_vec = ctx.meta
        idx = row_index(weight, inverse, mode, groups, n_vec)
        grad_x = None
        if x is not None:
            w_c = gather_rows(out_values.to(x.dtype), idx).reshape(weight.shape)
            grad_x = _matmul_16bit_safe(grad, w_c)
            del w_c
            grad_wc = grad.reshape(-1, grad.shape[-1]).t().float() @ x.reshape(-1, x.shape[-1]).float()
        else:
            grad_wc = grad.float()
        gv = grad_wc.reshape(-1, d)  # [N, d]
        if d == 1:
            if gv.is_cuda and torch.are_deterministic_algorithms_enabled():  # CUDA's weighted bincount adds atomically
                sums = gv.new_zeros(out_values.shape[0]).index_add_(0, idx, gv[:, 0])
            else:
                sums = torch.bincount(idx, weights=gv[:, 0], minlength=out_values.shape[0])
            grad_out = sums.unsqueeze(1).to(out_values.dtype)
            grad_w = jacobian[:, 0, 0].index_select(0, idx) * gv[:, 0]
        else:
            grad_out = torch.zeros_like(out_values).index_add_(0, idx, gv)
            grad_w = torch.einsum("nij,ni->nj", jacobian[idx], gv)
        return grad_x, grad_out, None, grad_w.reshape(weight.shape).to(weight.dtype), None, None, None, None


def _local_jacobian(u: torch.Tensor, cents: torch.Tensor, attn: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """`J[u, i, j] = d(A(u) C)_i / du_j` with C fixed: `[U, d, d]`, closed form of the softmax attention.

    `cents` is `[U, K, d]` (a table per row) or `[K, d]` (one table); `tau` broadcasts to `[U, 1, 1]`.
    """
    diff = u.unsqueeze(1) - cents  # [U, K, d]
    dist_ = (diff.square().sum(-1, keepdim=True) + 1e-12).sqrt()
    dz = -diff / (tau * dist_)  # [U, K, d]
    dz_bar = (attn.unsqueeze(-1) * dz).sum(1, keepdim=True)
    spec = "ki,uk,ukj->uij" if cents.dim() == 2 else "uki,uk,ukj->uij"
    return torch.einsum(spec, cents, attn, dz - dz_bar)


def _shard_bounds(rows: int, group) -> tuple[int, int, int, int]:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([rows]), group=group)
    if len({int(t) for t in sizes}) != 1:
        # Ranks would otherwise exchange differently sized shards and abort inside gloo/NCCL.
        raise RuntimeError(
            f"eDKM shard: the ranks hold different weights (unique-table rows per rank: {[int(t) for t in sizes]}); "
            "sharding needs identical replicas (data parallel with averaged gradients). Set DKMConfig(shard=False)."
        )
    per = -(-rows // world)
    lo = min(rows, rank * per)
    return lo, min(rows, lo + per), per, world


def table_dkm(
    values: torch.Tensor,
    table: WeightTable,
    centroids: torch.Tensor,
    tau: torch.Tensor,
    eps: torch.Tensor,
    iters: int,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DKM over table rows: returns (outputs `A @ C` per row `[U, d]`, local Jacobians `[U, d, d]`, centroids).

    `values` carries the gradient to the weight (`TableValues`); `tau`/`eps` are per group. With `group` each
    rank computes its slice of the table and the pieces are combined with differentiable collectives.
    """
    rows, groups = values.shape[0], table.groups
    lo, hi, per, world = _shard_bounds(rows, group) if group is not None else (0, rows, rows, 1)
    u, gid, cnt = values[lo:hi], table.gid[lo:hi], table.counts[lo:hi]
    c = centroids.float()
    k, d = c.shape[1], c.shape[2]
    single = groups == 1  # one table: plain broadcasting and matmuls instead of per-row gathers

    def table_of(cents: torch.Tensor) -> torch.Tensor:  # [K, d] for one table, else [U_l, K, d]
        return cents[0] if single else cents[gid]

    scale = tau[0] if single else tau[gid]  # scalar or [U_l]

    def attention(rows: torch.Tensor, cents: torch.Tensor) -> torch.Tensor:
        """A^T `[K, U_l]`: the softmax runs over dim 0 (CPU softmax over a last dim of size K is ~7x slower)."""
        per_row = cents.unsqueeze(1) if single else cents.transpose(0, 1)  # [K, 1 or U_l, d]
        dist_t = ((per_row - rows.unsqueeze(0)).square().sum(-1) + DIST_EPS).sqrt()  # [K, U_l]
        return torch.softmax(-dist_t / scale, dim=0)

    for _ in range(iters):
        attn_t = attention(u, table_of(c))
        weighted = attn_t if table.mode == "identity" else attn_t * cnt.unsqueeze(0)  # [K, U_l]
        if single:
            num, den = (weighted @ u).unsqueeze(0), weighted.sum(1).unsqueeze(0)
        else:
            num = u.new_zeros(groups, k, d).index_add(0, gid, weighted.t().unsqueeze(-1) * u.unsqueeze(1))
            den = u.new_zeros(groups, k).index_add(0, gid, weighted.t())
        if group is not None:
            num, den = dist_nn.all_reduce(num, group=group), dist_nn.all_reduce(den, group=group)
        new = torch.where(den.unsqueeze(-1) > 1e-30, num / den.clamp_min(1e-30).unsqueeze(-1), c)
        still = ((new - c).abs().amax(dim=(1, 2)) > eps).any()
        c = new
        if not bool(still):
            break
    cents = table_of(c)
    attn_t = attention(u.detach(), cents)
    out = attn_t.t() @ cents if single else torch.einsum("ku,ukd->ud", attn_t, cents)
    attn = attn_t.t()
    with torch.no_grad():
        tau_rows = tau[0] if single else tau[gid].view(-1, 1, 1)
        jac = _local_jacobian(u.detach(), cents.detach(), attn.detach(), tau_rows)
    if group is not None:
        pad = per - (hi - lo)
        out = torch.cat(dist_nn.all_gather(torch.nn.functional.pad(out, (0, 0, 0, pad)), group=group))[:rows]
        jac_parts = [jac.new_empty(per, d, d) for _ in range(world)]
        dist.all_gather(jac_parts, torch.nn.functional.pad(jac, (0, 0, 0, 0, 0, pad)).contiguous(), group=group)
        jac = torch.cat(jac_parts)[:rows]
    return out, jac, c.detach()


def run(x, weight, centroids, settings, group=None):
    """The engine interface (see `engines/__init__.py`): `(x @ W_c^T or W_c, refined centroids)`; `group` shards
    the table across its ranks."""
    cfg, groups, d = settings.config, settings.groups, settings.cluster_dim
    table = build_table(weight, groups, d, cfg.uniquify)
    std = table_std(table)
    values = TableValues.apply(weight, table.values, table.counts, table.inverse, table.mode, groups, d)
    out, jac, cents = table_dkm(
        values, table, centroids, cfg.temperature * std, cfg.epsilon * std, cfg.dkm_iters, group
    )
    return PaletteApply.apply(x, out, jac, weight, table.inverse, table.mode, groups, d), cents
