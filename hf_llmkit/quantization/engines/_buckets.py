"""DKM for 32-bit scalar weights in O(|W|) work per step: a fine grid of buckets, each expanded to second order.

32-bit weights are almost all distinct, so eDKM's unique-value table would be as large as the weight. Instead each
weight is written exactly as `u + r` on a grid of step `h <= tau / 32` (`_grid.py`). Everything DKM computes per
weight is a smooth function of `w` away from the centroids, so:

- the k-means sums `sum_i a(w_i)` and `sum_i a(w_i) w_i` are, per bucket, `n f(u) + S1 f'(u) + S2 f''(u) / 2` with the
  bucket's moments `n, S1 = sum r, S2 = sum r^2`: every DKM iteration costs O(buckets x K), not O(|W| x K);
- the output `A(w) C` and the weight gradient are evaluated per weight from a few per-bucket coefficients (a
  polynomial in `r`), the centroid gradients from per-bucket moments of the output gradient (`bucketed.py`);
- the Taylor remainder is `O((h / tau)^3)`; the tables are computed in float64 (`_jets.py`), so the result agrees with
  DKM evaluated in float64 to about 1e-7. Only next to a centroid is the attention not smooth (`|w - c|`, and the
  `DIST_EPS` smoothing inside `sqrt`); where a centroid has a neighbour closer than `SAFE_GAP` tau, the buckets
  around it are computed weight by weight instead (farther apart, the attention there is flat to e^-20).

The weight-by-weight set enters the same formulas as rows of its own (`u = w`, moments `(1, 0, 0)`). Row math runs in
chunks of `ROW_CHUNK` rows so its `[K, rows]` temporaries stay in cache. Nothing weight-sized is saved for backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hf_llmkit.quantization._dkm import DIST_EPS
from hf_llmkit.quantization.engines._grid import (
    Grid,
    Located,
    build_grid,
    chunks,
    evaluate,
    locate,
    members,
    rows_near,
)
from hf_llmkit.quantization.engines._jets import attention_jets, combine

SAFE_GAP = 20.0  # a centroid whose neighbours are this many tau away has a flat attention (to e^-20) around it
ROW_CHUNK = 1 << 15  # elements (rows x centroids) per chunk of the table math: [K, rows] temporaries stay in cache


@dataclass
class Rows:
    """Points the per-row math runs on: bucket centres (or exact weights) `u` `[R]`, their group, their moments."""

    u: torch.Tensor  # [R]
    gid: torch.Tensor  # [R] int64
    moments: torch.Tensor  # [3, R]: count, sum r, sum r^2

    def split(self, centroids: int) -> Iterator[tuple[slice, Rows]]:
        step = max(64, ROW_CHUNK // centroids)
        for start in range(0, self.u.shape[0], step):
            sl = slice(start, start + step)
            yield sl, Rows(self.u[sl], self.gid[sl], self.moments[:, sl])


@dataclass
class Stage:
    """One soft-assignment evaluation: its centroids `[G, K]` and the weights computed one by one (or None)."""

    cents: torch.Tensor
    kinks: torch.Tensor | None  # bucket rows left out of the expansion
    exact: torch.Tensor | None  # flat indices of their weights


def per_row(table: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    """Per-group values `[G, K]` as `[K, R]` for rows of groups `gid` (`[K, 1]`, broadcast, for one group)."""
    return table[0].unsqueeze(1) if table.shape[0] == 1 else table.index_select(0, gid).t()


def per_row_tau(tau: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    return tau[0] if tau.shape[0] == 1 else tau.index_select(0, gid)


def group_sum(gid: torch.Tensor, groups: int, mats: list[torch.Tensor], vecs: list[torch.Tensor]) -> torch.Tensor:
    """`sum_n mats[n] @ vecs[n]` within each group: `[G, K]` from `[K, R]` matrices and `[R]` row weights."""
    if groups == 1:
        return sum(m @ v for m, v in zip(mats, vecs)).unsqueeze(0)
    cols = sum(m * v for m, v in zip(mats, vecs))  # [K, R]
    return cols.new_zeros(cols.shape[0], groups).index_add_(1, gid, cols).t()


def grid_rows(grid: Grid, stage: Stage) -> Rows:
    """The grid's buckets as rows (the stage's weight-by-weight buckets get zero moments)."""
    moments = grid.moments
    if stage.kinks is not None:
        moments = moments.clone()
        moments[:, stage.kinks] = 0.0
    return Rows(grid.centers, grid.gid, moments)


def exact_rows(stage: Stage, w: torch.Tensor, dtype: torch.dtype) -> Rows | None:
    """The stage's weight-by-weight set as rows of their own: `u = w`, moments `(1, 0, 0)`."""
    if stage.exact is None:
        return None
    u = w.reshape(-1)[stage.exact].to(dtype)
    moments = torch.zeros(3, u.shape[0], dtype=dtype, device=u.device)
    moments[0] = 1.0
    return Rows(u, stage.exact // w.shape[1], moments)


def make_stage(loc: Located, grid: Grid, cents: torch.Tensor, tau: torch.Tensor) -> Stage:
    """The stage of centroids `[G, K]`: which buckets are computed weight by weight (see the module docstring)."""
    if cents.shape[1] < 2:
        return Stage(cents, None, None)
    ordered, order = cents.sort(dim=1)
    gap = ordered.diff(dim=1)  # [G, K - 1]
    inf = gap.new_full((cents.shape[0], 1), float("inf"))
    nearest = torch.minimum(torch.cat([inf, gap], 1), torch.cat([gap, inf], 1))  # each sorted centroid's neighbour
    crowded = nearest < SAFE_GAP * tau.unsqueeze(1)
    if not bool(crowded.any()):
        return Stage(cents, None, None)
    # the bucket holding a crowded centroid, and those within the smoothing radius of sqrt(x^2 + DIST_EPS)
    margin = grid.h.double().unsqueeze(1) / 2 + (DIST_EPS * tau.double().square()).sqrt().sqrt().unsqueeze(1)
    where = torch.where(crowded, ordered, torch.full_like(ordered, float("nan")))
    rows = rows_near(grid, where, margin)
    return Stage(cents, rows, None if rows is None else members(loc, grid, rows))


def stage_sums(rows: Rows, cents: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """k-means sums `[G, 2, K]` (sum a, sum a w) of the rows at centroids `[G, K]`."""
    groups = cents.shape[0]
    sums = cents.new_zeros(groups, 2, cents.shape[1])
    for _, part in rows.split(cents.shape[1]):
        u, (n, s1, s2) = part.u, part.moments
        a = attention_jets(u, per_row(cents, part.gid), per_row_tau(tau, part.gid), 2).a  # 3 x [K, R]
        half = 0.5 * s2
        sums[:, 0] += group_sum(part.gid, groups, a, [n, s1, half])
        # (a w)' = a' u + a, (a w)'' = a'' u + 2 a'
        sums[:, 1] += group_sum(part.gid, groups, a, [u * n + s1, u * s1 + s2, u * half])
    return sums


def centroid_update(sums: torch.Tensor, cents: torch.Tensor) -> torch.Tensor:
    """DKM's k-means step `C <- A^T W / A^T 1` (a centroid nobody attends keeps its value)."""
    den, num = sums[:, 0], sums[:, 1]
    return torch.where(den > 1e-30, num / den.clamp_min(1e-30), cents)


def output_coefficients(rows: Rows, cents: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """`[3, R]` coefficients of DKM's output `o + o' r + o'' r^2 / 2` around each row."""
    out = rows.u.new_empty(3, rows.u.shape[0])
    for sl, part in rows.split(cents.shape[1]):
        c = per_row(cents, part.gid)
        o = combine(attention_jets(part.u, c, per_row_tau(tau, part.gid), 2), c)
        out[:, sl] = torch.stack([o[0], o[1], 0.5 * o[2]])
    return out


def soft_weight(loc: Located, stage: Stage, table: torch.Tensor, exact: torch.Tensor | None) -> torch.Tensor:
    """DKM's soft-clustered weight `[G, n]` (float32) from the output table and the exact set's outputs."""
    out = torch.empty_like(loc.r)
    for sl, row, r in chunks(loc):
        out[:, sl] = evaluate(table, row, r).view(out.shape[0], -1)
    if exact is not None:
        out.view(-1)[stage.exact] = exact
    return out


def forward(w: torch.Tensor, cents: torch.Tensor, tau: torch.Tensor, eps: torch.Tensor, iters: int):
    """DKM's iterations over the grid, then its output: (grid, located weights, stages, k-means sums, output table,
    exact outputs).

    `w` is `[G, n]` float32, `cents` `[G, K]`, `tau` / `eps` `[G]` (the tables' dtype); iterations stop early like
    naive DKM's. The last stage holds the centroids the output uses.
    """
    grid = build_grid(w, tau)
    loc = locate(w, grid)
    stages, sums_all = [], []
    c = cents
    for _ in range(iters):
        stage = make_stage(loc, grid, c, tau)
        sums = stage_sums(grid_rows(grid, stage), c, tau)
        exact = exact_rows(stage, w, tau.dtype)
        if exact is not None:
            sums = sums + stage_sums(exact, c, tau)
        new = centroid_update(sums, c)
        stages.append(stage)
        sums_all.append(sums)
        converged = bool(((new - c).abs().amax(dim=1) <= eps).all())
        c = new
        if converged:
            break
    last = make_stage(loc, grid, c, tau)
    stages.append(last)
    table = output_coefficients(grid_rows(grid, last), c, tau)
    if last.kinks is not None:
        table[:, last.kinks] = 0.0
    exact = exact_rows(last, w, tau.dtype)
    exact_out = None if exact is None else output_coefficients(exact, c, tau)[0].float()
    return grid, loc, stages, sums_all, table.float(), exact_out
