"""DKM for 32-bit scalar weights in O(|W|) work per step: a fine grid of buckets, each expanded to second order.

32-bit weights are almost all distinct, so eDKM's unique-value table would be as large as the weight. Instead each
weight `w` is written exactly as `u + r`, `u` the nearest point of a grid of step `h <= tau / 64` (a power of two,
so `u` and `r` are exact) and `|r| <= h / 2`. Everything DKM computes per weight is a smooth function of `w` away
from the centroids, so:

- the k-means sums `sum_i a(w_i)` and `sum_i a(w_i) w_i` are, per bucket, `n f(u) + S1 f'(u) + S2 f''(u) / 2` with the
  bucket's moments `n, S1 = sum r, S2 = sum r^2`: every DKM iteration costs O(buckets x K), not O(|W| x K);
- the output `A(w) C` and the weight gradient are evaluated per weight from a few per-bucket coefficients (a
  polynomial in `r`), and the centroid gradients from per-bucket moments of the output gradient;
- the Taylor remainder is `O((h / tau)^3)`, about 1e-7 of the attention's range: fp32 rounding. Only next to a
  centroid is the attention not smooth (`|w - c|`); when two centroids of a table are closer than 20 tau the
  buckets around each centroid are computed weight by weight instead (below 20 tau their attention is flat to 1e-9).

Nothing weight-sized is saved for backward: the grid and the per-bucket tables are small, and each weight's bucket
and residual are recomputed from the weight itself (5 elementwise ops). `BucketedDKM` is the autograd function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_llmkit.quantization._dkm import DIST_EPS
from hf_llmkit.quantization._jets import attention_jets, combine

GRID_PER_TAU = 64  # grid step h: the largest power of two <= tau / 64
SAFE_GAP = 20.0  # centroids at least this many tau apart: the attention is flat (to e^-20) around each of them
MARGIN_H, MARGIN_S = 0.5, 1.0  # kink buckets: within h/2 + (DIST_EPS tau^2)^(1/4) of a centroid
MAX_DENSE_KEYS = 1 << 22  # a dense key -> bucket map up to this size (or 8 keys per weight); else a sorted unique


@dataclass
class Grid:
    """The bucket grid of one weight `[G, n]`: per-group step, first grid index, and the occupied buckets."""

    h: torch.Tensor  # [G] float32, a power of two
    inv_h: torch.Tensor  # [G] float32, exact inverse
    kmin: torch.Tensor  # [G] float32 (integer-valued): grid index of the group's smallest weight
    span: int  # grid indices per group
    row_of: torch.Tensor | None  # [G * span] int32: bucket row of each key, -1 where empty (None: sorted unique)
    centers: torch.Tensor  # [U] float64, bucket centres u
    gid: torch.Tensor  # [U] int64, group of each bucket
    moments: torch.Tensor  # [3, U] float64: count, sum r, sum r^2

    @property
    def rows(self) -> int:
        return self.centers.shape[0]


def _grid_index(w, h, inv_h, kmin, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(global key `[G * n]` int64, residual `r = w - u` `[G * n]` float32) of every weight `w` `[G, n]`."""
    t = (w * inv_h.unsqueeze(1)).round_()  # grid index, exact (inv_h is a power of two)
    r = torch.addcmul(w, t, h.unsqueeze(1), value=-1.0)  # w - t h, exact
    t -= kmin.unsqueeze(1)
    if w.shape[0] > 1:
        t += (torch.arange(w.shape[0], device=w.device, dtype=t.dtype) * span).unsqueeze(1)
    return t.reshape(-1).int(), r.reshape(-1)


def locate(w: torch.Tensor, grid: Grid, inverse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket row `[G * n]`, residual `[G * n]`) of every weight; `inverse` is the sorted-unique fallback's map."""
    key, r = _grid_index(w, grid.h, grid.inv_h, grid.kmin, grid.span)
    row = inverse if grid.row_of is None else grid.row_of.index_select(0, key)
    return row, r


@torch.no_grad()
def build_grid(w: torch.Tensor, tau: torch.Tensor) -> tuple[Grid, torch.Tensor, torch.Tensor]:
    """The grid of a float32 weight `[G, n]` for temperatures `tau` `[G]` (whose dtype the tables use); also returns
    (row, r) of every weight."""
    groups = w.shape[0]
    h = torch.exp2(torch.floor(torch.log2(tau.float() / GRID_PER_TAU)))  # [G]
    inv_h = 1.0 / h
    kmin = (w.amin(1) * inv_h).round()
    span = int(((w.amax(1) * inv_h).round() - kmin).max()) + 1
    key, r = _grid_index(w, h, inv_h, kmin, span)
    r2, dtype = r.square(), tau.dtype
    if groups * span <= max(MAX_DENSE_KEYS, 8 * key.numel()):
        counts = torch.bincount(key, minlength=groups * span)
        present = counts.nonzero().squeeze(1)  # [U] keys of occupied buckets
        row_of = torch.full((groups * span,), -1, dtype=torch.int32, device=w.device)
        row_of[present] = torch.arange(present.numel(), dtype=torch.int32, device=w.device)
        row = row_of.index_select(0, key)
        n = counts[present]
        s1 = torch.bincount(key, weights=r, minlength=groups * span)[present]
        s2 = torch.bincount(key, weights=r2, minlength=groups * span)[present]
    else:  # a few huge outliers stretch the grid: sort the keys instead of a dense map
        present, row, counts = torch.unique(key, return_inverse=True, return_counts=True)
        row_of, n = None, counts
        s1 = r.new_zeros(n.shape).index_add_(0, row, r)
        s2 = r.new_zeros(n.shape).index_add_(0, row, r2)
        row = row.to(torch.int32)
    gid = present // span
    centers = ((present % span).float() + kmin[gid]) * h[gid]  # exact: integer-valued float x power of two
    moments = torch.stack([n.to(dtype), s1.to(dtype), s2.to(dtype)])
    grid = Grid(h, inv_h, kmin, span, row_of, centers.to(dtype), gid, moments)
    return grid, row, r


def per_row(grid: Grid, table: torch.Tensor) -> torch.Tensor:
    """Per-group values `[G, K]` as `[K, U]` per bucket row (`[K, 1]`, broadcast, when there is one group)."""
    return table[0].unsqueeze(1) if table.shape[0] == 1 else table.t()[:, grid.gid]


def per_row_tau(grid: Grid, tau: torch.Tensor) -> torch.Tensor:
    return tau[0] if tau.shape[0] == 1 else tau[grid.gid]


def member_params(stage: Stage, tau: torch.Tensor, per: int):
    """(values' groups `[M]`, centroids `[K, M]` or `[K, 1]`, tau `[M]` or scalar) of the stage's exact set."""
    g = stage.exact // per
    if stage.cents.shape[0] == 1:
        return g, stage.cents[0].unsqueeze(1), tau[0]
    return g, stage.cents.index_select(0, g).t(), tau.index_select(0, g)


def group_sum(grid: Grid, mats: list[torch.Tensor], vecs: list[torch.Tensor], groups: int) -> torch.Tensor:
    """`sum_n mats[n] @ vecs[n]` within each group: `[G, K]` from `[K, U]` matrices and `[U]` row weights."""
    if groups == 1:
        return sum(m @ v for m, v in zip(mats, vecs)).unsqueeze(0)
    rows = sum(m * v for m, v in zip(mats, vecs))  # [K, U]
    return rows.new_zeros(rows.shape[0], groups).index_add_(1, grid.gid, rows).t()


def kink_rows(grid: Grid, cents: torch.Tensor, tau: torch.Tensor) -> torch.Tensor | None:
    """Bucket rows that must be computed weight by weight for centroids `[G, K]`, or None when none need it.

    A bucket's expansion fails where it straddles a centroid (`|w - c|` has a kink) or lies inside the smoothing
    radius of `sqrt((w - c)^2 + DIST_EPS)`; it only matters when another centroid of the table is within
    `SAFE_GAP` tau (otherwise the attention there is 1 to within e^-20).
    """
    ordered = cents.sort(dim=1).values
    if ordered.shape[1] < 2 or bool((ordered.diff(dim=1) >= SAFE_GAP * tau.unsqueeze(1)).all()):
        return None
    h = grid.h.double().unsqueeze(1)  # [G, 1]
    margin = h * MARGIN_H + MARGIN_S * (DIST_EPS * tau.square()).sqrt().sqrt().unsqueeze(1)
    lo = torch.ceil((cents - margin) / h)  # [G, K] first and last grid index touched
    hi = torch.floor((cents + margin) / h)
    width = int((hi - lo).max()) + 1
    j = lo.unsqueeze(-1) + torch.arange(width, dtype=lo.dtype, device=lo.device)  # [G, K, W]
    local = j - grid.kmin.double().view(-1, 1, 1)
    ok = (j <= hi.unsqueeze(-1)) & (local >= 0) & (local < grid.span)
    key = (local + (torch.arange(cents.shape[0], device=lo.device) * grid.span).view(-1, 1, 1))[ok].long()
    if grid.row_of is not None:
        rows = grid.row_of[key].long()
    else:
        keys = grid.gid * grid.span + ((grid.centers / grid.h.double()[grid.gid]).round() - grid.kmin[grid.gid])
        rows = torch.searchsorted(keys.long(), key).clamp_max(grid.rows - 1)
        rows = rows[keys.long()[rows] == key]
    rows = rows[rows >= 0].unique()
    return rows if rows.numel() else None


def members(row: torch.Tensor, rows: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
    """Flat indices of the weights whose bucket is one of `rows`."""
    if rows is None:
        return None
    flag = torch.zeros(num_rows, dtype=torch.bool, device=row.device)
    flag[rows] = True
    return flag[row].nonzero().squeeze(1)


@dataclass
class Stage:
    """One soft-assignment evaluation: its centroids `[G, K]` and the weights computed one by one (or None)."""

    cents: torch.Tensor
    kinks: torch.Tensor | None  # bucket rows excluded from the expansion
    exact: torch.Tensor | None  # flat indices of their weights


def _masked_moments(grid: Grid, stage: Stage) -> torch.Tensor:
    if stage.kinks is None:
        return grid.moments
    moments = grid.moments.clone()
    moments[:, stage.kinks] = 0.0
    return moments


def stage_sums(grid: Grid, stage: Stage, tau: torch.Tensor, w_flat: torch.Tensor, per: int) -> torch.Tensor:
    """k-means sums `[G, 2, K]` (sum a, sum a w) over all weights at the stage's centroids (float64)."""
    groups, u = stage.cents.shape[0], grid.centers
    n, s1, s2 = _masked_moments(grid, stage)
    a = attention_jets(u, per_row(grid, stage.cents), per_row_tau(grid, tau), 2).a  # 3 x [K, U]
    half = 0.5 * s2
    den = group_sum(grid, a, [n, s1, half], groups)
    num = group_sum(grid, a, [u * n + s1, u * s1 + s2, u * half], groups)  # (a w)' = a' u + a, (a w)'' = a'' u + 2a'
    sums = torch.stack([den, num], dim=1)
    if stage.exact is not None:
        wv = w_flat[stage.exact].to(tau.dtype)
        g, cents, tau_m = member_params(stage, tau, per)
        a0 = attention_jets(wv, cents, tau_m, 0).a[0]  # [K, M]
        sums = sums.index_add(0, g, torch.stack([a0, a0 * wv], dim=1).permute(2, 1, 0))
    return sums


def centroid_update(sums: torch.Tensor, cents: torch.Tensor) -> torch.Tensor:
    """DKM's k-means step `C <- A^T W / A^T 1` (a centroid nobody attends keeps its value)."""
    den, num = sums[:, 0], sums[:, 1]
    return torch.where(den > 1e-30, num / den.clamp_min(1e-30), cents)


def output_table(grid: Grid, stage: Stage, tau: torch.Tensor) -> torch.Tensor:
    """Per-bucket coefficients `[3, U]` (float32) of the output polynomial `o + o' r + o'' r^2 / 2`."""
    cents = per_row(grid, stage.cents)
    o = combine(attention_jets(grid.centers, cents, per_row_tau(grid, tau), 2), cents)
    table = torch.stack([o[0], o[1], 0.5 * o[2]])
    if stage.kinks is not None:
        table[:, stage.kinks] = 0.0
    return table.float()


def evaluate(table: torch.Tensor, row: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """`c0 + r (c1 + r c2)` per weight from a `[3, U]` coefficient table (three 1-D gathers: fastest on CPU)."""
    c0, c1, c2 = (table[i].index_select(0, row) for i in range(3))
    return torch.addcmul(c0, r, torch.addcmul(c1, r, c2))


def exact_outputs(stage: Stage, tau: torch.Tensor, w_flat: torch.Tensor, per: int) -> torch.Tensor:
    """DKM's output `A(w) C` (float64) of the stage's weight-by-weight set."""
    _, cents, tau_m = member_params(stage, tau, per)
    return combine(attention_jets(w_flat[stage.exact].to(tau.dtype), cents, tau_m, 0), cents)[0]


def forward_stages(
    w: torch.Tensor, cents: torch.Tensor, tau: torch.Tensor, eps: torch.Tensor, iters: int
) -> tuple[Grid, torch.Tensor, torch.Tensor, list[Stage], list[torch.Tensor]]:
    """DKM's centroid iterations over the grid: (grid, row, r, stages, k-means sums of every iteration).

    `w` is `[G, n]` float32, `cents` `[G, K]`, `tau` / `eps` `[G]` (float64); iterations stop early like naive DKM's.
    """
    grid, row, r = build_grid(w, tau)
    w_flat, per = w.reshape(-1), w.shape[1]
    stages, sums_all = [], []
    c = cents
    for _ in range(iters):
        stage = _stage(grid, row, c, tau)
        sums = stage_sums(grid, stage, tau, w_flat, per)
        new = centroid_update(sums, c)
        stages.append(stage)
        sums_all.append(sums)
        moved = bool(((new - c).abs().amax(dim=1) <= eps).all())
        c = new
        if moved:
            break
    stages.append(_stage(grid, row, c, tau))
    return grid, row, r, stages, sums_all


def _stage(grid: Grid, row: torch.Tensor, cents: torch.Tensor, tau: torch.Tensor) -> Stage:
    kinks = kink_rows(grid, cents, tau)
    return Stage(cents, kinks, members(row, kinks, grid.rows))
