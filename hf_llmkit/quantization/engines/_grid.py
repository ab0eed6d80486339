"""The bucket grid of the 32-bit DKM engine and every pass it makes over the weights, in cache-sized chunks.

Each weight `w` of group `g` is written exactly as `u + r`: `u = t h` the nearest point of a grid of step `h` (a power
of two, so `t = round(w / h)`, `u` and `r` are exact) and `|r| <= h / 2`. Occupied grid points are the buckets
(table rows). Per-weight work runs over column chunks of the `[G, n]` weight (`CHUNK` values at a time): its
temporaries stay in cache and are recycled by the allocator, where whole-weight temporaries would be fresh
page-faulting allocations for every elementwise op (most of the time at 16M weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

GRID_PER_TAU = 32  # grid step h: the largest power of two <= tau / 32
CHUNK = 1 << 18  # weights per chunk of a per-weight pass
MAX_DENSE_KEYS = 1 << 22  # a dense key -> bucket map up to this size (or 4 keys per weight); else a sorted unique


@dataclass
class Grid:
    """The bucket grid of one weight `[G, n]`: per-group step and first grid index, and the occupied buckets."""

    h: torch.Tensor  # [G] float32, a power of two
    inv_h: torch.Tensor  # [G] float32, its exact inverse
    kmin: torch.Tensor  # [G] float32 (integer-valued): grid index of the group's smallest weight
    span: int  # grid indices per group
    row_of: torch.Tensor | None  # [G * span] int32: bucket row of each key, -1 where empty (None: sorted unique)
    inverse: torch.Tensor | None  # [G, n] int32 bucket row of every weight (sorted-unique fallback only)
    centers: torch.Tensor  # [U] bucket centres u (the tables' dtype)
    gid: torch.Tensor  # [U] int64, group of each bucket
    moments: torch.Tensor  # [3, U]: count, sum r, sum r^2 (the tables' dtype)

    @property
    def rows(self) -> int:
        return self.centers.shape[0]

    @property
    def groups(self) -> int:
        return self.h.shape[0]


def _key(w: torch.Tensor, h, inv_h, kmin, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(global key `[G * c]` int32, residual `r = w - u` `[G * c]` float32) of a chunk `w` `[G, c]`."""
    t = (w * inv_h.unsqueeze(1)).round_()  # grid index, exact (inv_h is a power of two)
    r = torch.addcmul(w, t, h.unsqueeze(1), value=-1.0)  # w - t h, exact
    t -= kmin.unsqueeze(1)
    if w.shape[0] > 1:
        t += (torch.arange(w.shape[0], device=w.device, dtype=t.dtype) * span).unsqueeze(1)
    return t.reshape(-1).int(), r.reshape(-1)


def column_slices(n: int, groups: int) -> Iterator[slice]:
    step = max(1, CHUNK // groups)
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


@dataclass
class Located:
    """Every weight's bucket row and residual, `[G, n]` each (temporaries of one forward or backward)."""

    row: torch.Tensor  # int32
    r: torch.Tensor  # float32


def locate(w: torch.Tensor, grid: Grid) -> Located:
    """Bucket row and residual of every weight `[G, n]` (chunked: small temporaries)."""
    if grid.row_of is None:
        return Located(grid.inverse, _key(w, grid.h, grid.inv_h, grid.kmin, grid.span)[1].view_as(w))
    loc = Located(torch.empty(w.shape, dtype=torch.int32, device=w.device), torch.empty_like(w))
    for sl in column_slices(w.shape[1], w.shape[0]):
        key, r = _key(w[:, sl], grid.h, grid.inv_h, grid.kmin, grid.span)
        loc.row[:, sl] = grid.row_of.index_select(0, key).view(w.shape[0], -1)
        loc.r[:, sl] = r.view(w.shape[0], -1)
    return loc


def chunks(loc: Located) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """(column slice, bucket row `[G * c]`, residual `[G * c]`) over the column chunks, each in `[G, c]` order."""
    for sl in column_slices(loc.row.shape[1], loc.row.shape[0]):
        yield sl, loc.row[:, sl].reshape(-1), loc.r[:, sl].reshape(-1)


def flat_index(local: torch.Tensor, sl: slice, n: int) -> torch.Tensor:
    """Flat `[G * n]` indices of positions `local` in a chunk `[G, c]` flattened."""
    width = sl.stop - sl.start
    return local // width * n + sl.start + local % width


@torch.no_grad()
def build_grid(w: torch.Tensor, tau: torch.Tensor) -> Grid:
    """The grid of a float32 weight `[G, n]` for temperatures `tau` `[G]`; tables use `tau`'s dtype."""
    groups, n = w.shape
    h = torch.exp2(torch.floor(torch.log2(tau.float() / GRID_PER_TAU)))
    inv_h = 1.0 / h
    kmin = (w.amin(1) * inv_h).round()
    span = int(((w.amax(1) * inv_h).round() - kmin).max()) + 1
    keys = groups * span
    if keys <= max(MAX_DENSE_KEYS, 4 * w.numel()):
        count, s1, s2 = w.new_zeros(keys, dtype=torch.float64), w.new_zeros(keys), w.new_zeros(keys)
        ones = w.new_ones(max(1, CHUNK // groups) * groups, dtype=torch.float64)
        for sl in column_slices(n, groups):
            key, r = _key(w[:, sl], h, inv_h, kmin, span)
            count.index_add_(0, key, ones[: key.numel()])
            s1.index_add_(0, key, r)
            s2.index_add_(0, key, r.square_())
        present = count.nonzero().squeeze(1)  # keys of occupied buckets, ascending
        row_of = torch.full((keys,), -1, dtype=torch.int32, device=w.device)
        row_of[present] = torch.arange(present.numel(), dtype=torch.int32, device=w.device)
        inverse = None
        moments = torch.stack([count[present], s1[present].double(), s2[present].double()])
    else:  # a few huge outliers stretch the grid: sort the keys instead of a dense map
        key, r = _key(w, h, inv_h, kmin, span)
        present, inv, count = torch.unique(key.long(), return_inverse=True, return_counts=True)
        row_of, inverse = None, inv.to(torch.int32).reshape(groups, n)
        s1 = r.new_zeros(count.shape).index_add_(0, inv, r)
        s2 = r.new_zeros(count.shape).index_add_(0, inv, r.square_())
        moments = torch.stack([count.double(), s1.double(), s2.double()])
    gid = present // span
    centers = ((present % span).float() + kmin[gid]) * h[gid]  # exact: integer-valued float x power of two
    return Grid(h, inv_h, kmin, span, row_of, inverse, centers.to(tau.dtype), gid, moments.to(tau.dtype))


def rows_near(grid: Grid, cents: torch.Tensor, margin: torch.Tensor) -> torch.Tensor | None:
    """Bucket rows whose centre is within `margin` `[G, 1]` of a centroid `[G, K]` (NaN: skip), or None if none."""
    h = grid.h.double().unsqueeze(1)  # [G, 1]
    cents = cents.double()
    lo, hi = torch.ceil((cents - margin) / h), torch.floor((cents + margin) / h)  # [G, K] grid indices touched
    extent = (hi - lo)[torch.isfinite(cents)]  # NaN centroids are skipped
    if extent.numel() == 0:
        return None
    width = int(extent.max().clamp_min(0)) + 1
    j = lo.unsqueeze(-1) + torch.arange(width, dtype=lo.dtype, device=lo.device)  # [G, K, W]
    local = j - grid.kmin.double().view(-1, 1, 1)
    ok = (j <= hi.unsqueeze(-1)) & (local >= 0) & (local < grid.span)
    key = (local + (torch.arange(cents.shape[0], device=lo.device) * grid.span).view(-1, 1, 1))[ok].long()
    if grid.row_of is not None:
        rows = grid.row_of[key].long()
    else:
        row_keys = grid.gid * grid.span + (grid.centers.double() / h.squeeze(1)[grid.gid]).round().long()
        row_keys -= grid.kmin.long()[grid.gid]
        rows = torch.searchsorted(row_keys, key).clamp_max(grid.rows - 1)
        rows = torch.where(row_keys[rows] == key, rows, -1)
    rows = rows[rows >= 0].unique()
    return rows if rows.numel() else None


def members(loc: Located, grid: Grid, rows: torch.Tensor) -> torch.Tensor:
    """Flat `[G * n]` indices of the weights whose bucket is one of `rows`."""
    flag = torch.zeros(grid.rows, dtype=torch.bool, device=rows.device)
    flag[rows] = True
    n = loc.row.shape[1]
    return torch.cat([flat_index(flag.index_select(0, row).nonzero().squeeze(1), sl, n) for sl, row, _ in chunks(loc)])


def evaluate(table: torch.Tensor, row: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """`c0 + r (c1 + r c2)` per weight from a `[3, U]` float32 coefficient table (1-D gathers: fastest on CPU)."""
    c0, c1, c2 = (table[i].index_select(0, row) for i in range(3))
    return torch.addcmul(c0, r, c1.addcmul_(r, c2))
