"""DKM math shared by the layers and every engine: vector views, distances, k-means initialisation, hard assignment.

A weight `[rows, cols]` is viewed as `G` groups of `n` vectors of length `d` (`[G, n, d]`), each group with its
own table of `K = 2**bits` centroids (`[G, K, d]`). The soft assignment (training) is computed by the engines in
`engines/`; the hard assignment (evaluation, export) and the k-means that initialises the tables are here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

# Added under the square root of the distance: keeps its gradient finite at a zero distance.
DIST_EPS = 1e-12
# Chunk of weight vectors per step of the (non-differentiable) hard assignment; bounds its temporary memory.
ASSIGN_CHUNK = 1 << 20


def autocast_off(backward):
    """Decorate an autograd Function's `backward` to run with autocast off: a backward called inside
    `torch.autocast` would otherwise recast its float32 matmuls (the weight gradient) to 16 bits."""

    @functools.wraps(backward)
    def run(ctx, *grads):
        device = next((g.device.type for g in grads if isinstance(g, torch.Tensor)), "cpu")
        with torch.autocast(device, enabled=False):
            return backward(ctx, *grads)

    return run


def to_vectors(weight: torch.Tensor, groups: int, cluster_dim: int) -> torch.Tensor:
    """View a `[rows, cols]` weight as `[G, n, d]` vectors (a view, no copy, for a contiguous weight)."""
    return weight.reshape(groups, -1, cluster_dim)


def distance(vectors: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Euclidean distance `[..., n, K]` between vectors `[..., n, d]` and centroids `[..., K, d]`."""
    diff = vectors.unsqueeze(-2) - centroids.unsqueeze(-3)  # [..., n, K, d]
    return (diff.square().sum(-1) + DIST_EPS).sqrt()


def group_std(vectors: torch.Tensor) -> torch.Tensor:
    """Population standard deviation of each group `[G]` (detached), the unit of temperature and epsilon."""
    v = vectors.detach().float()
    return v.reshape(v.shape[0], -1).std(dim=1, unbiased=False).clamp_min(1e-12)


@torch.no_grad()
def hard_assign(vectors: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index `[G, n]` (int64) of the nearest centroid of every vector: scalars by a search among the midpoints of
    the sorted table (a value exactly at a midpoint takes the smaller entry; equal entries, the first), vectors by
    distances to every centroid, in chunks (the smallest index among equally near ones)."""
    if vectors.shape[-1] == 1:
        if _by_pattern(vectors):
            return _nearest_by_pattern(vectors[..., 0], centroids[..., 0])
        return _nearest_scalar(vectors[..., 0], centroids[..., 0])
    c = centroids.float()
    out = torch.empty(vectors.shape[:2], dtype=torch.long, device=vectors.device)
    for start in range(0, vectors.shape[1], ASSIGN_CHUNK):
        chunk = vectors[:, start : start + ASSIGN_CHUNK].float()
        out[:, start : start + ASSIGN_CHUNK] = torch.cdist(chunk, c).argmin(-1)
    return out


def _nearest_scalar(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Nearest entry of `table` `[G, K]` for each of `values` `[G, n]`, exactly (no distance arithmetic)."""
    table = table.float()
    order = table.argsort(dim=1, stable=True)
    ranked = table.gather(1, order)
    midpoints = (ranked[:, 1:] + ranked[:, :-1]) / 2
    first = order.gather(1, torch.searchsorted(ranked, ranked))  # each rank's first entry of its value
    return first.gather(1, torch.searchsorted(midpoints.contiguous(), values.float().contiguous()))


PATTERNS = 1 << 16  # the values a 16-bit float can hold


def _by_pattern(vectors: torch.Tensor) -> bool:
    """Whether 16-bit scalars are assigned faster through their bit patterns: each table's answer for all 65,536
    patterns costs as much as that many weights, so only tables of at least four times as many weights take it."""
    return vectors.element_size() == 2 and vectors.is_floating_point() and vectors.shape[1] >= 4 * PATTERNS


def _nearest_by_pattern(values: torch.Tensor, table: torch.Tensor, decoded: bool = False) -> torch.Tensor:
    """`_nearest_scalar` of 16-bit `values` `[G, n]`, bit for bit (or, `decoded`, the float32 table entries it
    picks): the answer for every possible bit pattern, then one lookup per weight by its pattern (a 16-bit float
    widens to float32 exactly, so each weight gets the answer its own value would; a search per weight costs
    several times more)."""
    groups = values.shape[0]
    patterns = torch.arange(PATTERNS, dtype=torch.int32, device=values.device).to(torch.int16).view(values.dtype)
    answers = _nearest_scalar(patterns.expand(groups, -1), table)  # [G, 65536]
    if decoded:
        answers = table.float().gather(1, answers)
    key = values.contiguous().view(torch.int16).to(torch.int32) & (PATTERNS - 1)
    if groups > 1:
        key += torch.arange(groups, dtype=torch.int32, device=values.device).unsqueeze(1) * PATTERNS
    return answers.reshape(-1).index_select(0, key.reshape(-1)).reshape(values.shape)


def hard_decode(vectors: torch.Tensor, table: torch.Tensor, shape, scales: torch.Tensor | None) -> torch.Tensor:
    """`decode(table, hard_assign(vectors, table), shape, scales)`, bit for bit; 16-bit scalars without scales in a
    large table in one lookup per weight (`_nearest_by_pattern`), no index tensor."""
    if scales is None and vectors.shape[-1] == 1 and _by_pattern(vectors):
        return _nearest_by_pattern(vectors[..., 0], table[..., 0], decoded=True).reshape(shape)
    return decode(table, hard_assign(vectors, table), shape, scales)


def lookup(centroids: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Vectors `[G, n, d]` of a table `[G, K, d]` at indices `[G, n]`."""
    return torch.gather(centroids, 1, indices.unsqueeze(-1).expand(-1, -1, centroids.shape[-1]))


def _initial_centroids(sample: torch.Tensor, k: int) -> torch.Tensor:
    """Quantile initialisation `[G, K, d]`: vectors at evenly spaced ranks of their first coordinate."""
    order = sample[..., 0].argsort(dim=1)  # [G, m]
    m = sample.shape[1]
    ranks = ((torch.arange(k, device=sample.device, dtype=torch.float64) + 0.5) * m / k).long().clamp_max(m - 1)
    picks = order[:, ranks]  # [G, K]
    return torch.gather(sample, 1, picks.unsqueeze(-1).expand(-1, -1, sample.shape[-1])).clone()


@torch.no_grad()
def kmeans(vectors: torch.Tensor, k: int, iters: int, sample: int, seed: int = 0) -> torch.Tensor:
    """Batched Lloyd k-means per group: centroids `[G, K, d]` (float32) of `vectors` `[G, n, d]`.

    Groups larger than `sample` vectors are clustered on a fixed-seed uniform sample, so initialising a
    LLaMA-sized layer takes a fraction of a second per table, not minutes. Scalars (`d == 1`) take
    `weighted_kmeans_1d` (the same iterations, sorted centroids, O(K log n) per step after one sort).
    """
    groups, n, d = vectors.shape
    if n > sample:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        pick = torch.randint(n, (groups, sample), generator=gen).to(vectors.device)
        data = torch.gather(vectors, 1, pick.unsqueeze(-1).expand(-1, -1, d)).float()
    else:
        data = vectors.float()
    centroids = _initial_centroids(data, k)
    if d == 1:  # scalars: Lloyd by a search among sorted centroids, no [n, K] distance matrix
        return weighted_kmeans_1d(data[..., 0], torch.ones_like(data[..., 0]), centroids[..., 0], iters).unsqueeze(-1)
    for _ in range(iters):
        assign = torch.cdist(data, centroids).argmin(-1)  # [G, m]
        sums = torch.zeros_like(centroids).scatter_add_(1, assign.unsqueeze(-1).expand(-1, -1, d), data)
        counts = torch.zeros(centroids.shape[:2], device=data.device).scatter_add_(
            1, assign, torch.ones_like(assign, dtype=torch.float32)
        )
        new = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp_min(1).unsqueeze(-1), centroids)
        if torch.equal(new, centroids):
            break
        centroids = new
    return centroids


@torch.no_grad()
def block_scales(weight: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Absmax of every `block` consecutive input features of each row of a `[rows, cols]` weight, `[rows, cols /
    block]` float32, rounded to `dtype` (as saved; clamped to its range) with 1 for an all-zero block."""
    rows, cols = weight.shape
    amax = weight.detach().float().abs().reshape(rows, cols // block, block).amax(-1)
    amax = amax.clamp_max(torch.finfo(dtype).max).to(dtype).float()
    return torch.where(amax > 0, amax, torch.ones_like(amax))


def expand_scales(scales: torch.Tensor, cols: int) -> torch.Tensor:
    """Block scales `[rows, blocks]` spread over the `cols` input features they scale, `[rows, cols]`."""
    return scales.repeat_interleave(cols // scales.shape[1], dim=1)


@dataclass(frozen=True)
class Importance:
    """What each weight counts in DKM's centroid update, as `calibrate` counts its share of the output error (and
    `calibration.refit_tables` fits the tables by): its input feature's energy `column` `[cols]` (the diagonal of the
    input moments, `H_jj`) times its block scale squared (`scales` `[rows, cols / block]`; None: 1). Kept factored,
    so nothing weight-sized is held for backward; `dense` builds the per-weight values where they are needed."""

    column: torch.Tensor
    scales: torch.Tensor | None = None

    def dense(self, rows: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """Each weight's importance, `[G, n]` in `dtype`, for a `[rows, cols]` weight in `G` groups of rows."""
        h = self.column.detach().to(dtype).expand(rows, -1)
        if self.scales is not None:
            h = h * expand_scales(self.scales.detach().to(dtype), h.shape[1]).square()
        return h.reshape(groups, -1)


def decode(table: torch.Tensor, indices: torch.Tensor, shape, scales: torch.Tensor | None) -> torch.Tensor:
    """The float32 weight `shape` of a table `[G, K, d]` at indices `[G, n]`, times its block scales (if any): what
    the hard assignment, the packed layers and a reloaded checkpoint compute, in one place so they agree bitwise."""
    w = lookup(table.float(), indices).reshape(shape)
    return w if scales is None else w * expand_scales(scales.float(), shape[1])


@torch.no_grad()
def weighted_kmeans_1d(values: torch.Tensor, weights: torch.Tensor, centroids: torch.Tensor, iters: int):
    """Lloyd k-means of scalars `values` `[G, n]` counted by `weights` `[G, n]` (>= 0), from `centroids` `[G, K]`;
    returns sorted centroids `[G, K]` (float32). The values are sorted once, with running sums (float64) of the
    weights and weighted values: every cell of a sorted table is then a run of sorted values between two midpoints
    (a value exactly at a midpoint takes the smaller entry), found by K - 1 binary searches, and its weighted mean
    is a difference of running sums, so a step costs O(K log n), not O(n); a centroid no weight chooses stays."""
    x, order = _sort_rows(values.float())
    wt = weights.float().gather(1, order).double()
    zero = torch.zeros(x.shape[0], 1, dtype=torch.float64, device=x.device)
    mass = torch.cat([zero, wt.cumsum(1)], 1)  # [G, n + 1]: mass[i] = weight of the i smallest values
    moment = torch.cat([zero, (x.double() * wt).cumsum(1)], 1)
    c = centroids.float().sort(dim=1).values
    ends = torch.full((x.shape[0], 1), x.shape[1], dtype=torch.long, device=x.device)
    for _ in range(iters):
        cuts = torch.searchsorted(x, ((c[:, 1:] + c[:, :-1]) / 2).contiguous(), right=True)  # values <= midpoint
        bounds = torch.cat([torch.zeros_like(ends), cuts, ends], 1)  # [G, K + 1]: cell j = [bounds j, bounds j+1)
        den = mass.gather(1, bounds[:, 1:]) - mass.gather(1, bounds[:, :-1])
        num = moment.gather(1, bounds[:, 1:]) - moment.gather(1, bounds[:, :-1])
        new = torch.where(den > 0, (num / den.clamp_min(torch.finfo(torch.float64).tiny)).float(), c)
        new = new.sort(dim=1).values
        if torch.equal(new, c):
            break
        c = new
    return c


def _sort_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.sort(dim=1)` of a `[G, n]` tensor; on CPU by numpy's argsort, several times faster there than torch's sort
    for the millions of weights of a layer (the order of equal values may differ: it never matters to a sum)."""
    if x.device.type != "cpu":
        return x.sort(dim=1)
    order = torch.from_numpy(np.argsort(x.detach().numpy(), axis=1)).to(torch.long)
    return x.gather(1, order), order
