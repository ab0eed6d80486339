"""The interval engine: DKM's scalar soft assignment in closed form, O(|W|) work whatever the number of tables.

For scalar weights DKM's attention is `a_k(w) = softmax_k(-|w - c_k| / tau)`. Sort a table's centroids; a weight `w`
in interval `j` (`c_{j-1} < w <= c_j`, `j = 0..K`) has `|w - c_k| = (w - c_{j-1}) + (c_{j-1} - c_k)` for every
centroid on its left (`k < j`) and `(c_j - w) + (c_k - c_j)` on its right, so the attention splits into a per-interval
constant and one number per weight, the share `u` of the left centroids:

    u(w) = sigmoid(2 (m_j - w) / tau + l_j),   m_j = (c_{j-1} + c_j) / 2,   l_j = log(L_j / R_j)
    a_k(w) = u P_jk (k < j),  (1 - u) Q_jk (k >= j)

with `L_j = sum_{k<j} e^{-(c_{j-1} - c_k)/tau}`, `P_jk` its normalised terms (`R_j`, `Q_jk` on the right). So

- DKM's output is `o(w) = B_j + (A_j - B_j) u(w)` (`A_j`, `B_j` the left and right attention-weighted centroids);
- the k-means sums `sum_i a_k(w_i)`, `sum_i a_k(w_i) w_i` need only, per interval, `sum u`, `sum u w`, the count and
  `sum w` of its weights (`_Sums`), contracted with the `[K+1, K]` tables `P`, `Q`.

Per weight a step is a handful of elementwise ops, one gather per table and one scatter-add per sum; everything
with `K` in it lives in `[G, K+1]` tables (in the weight's dtype, float32 for 16-bit weights; autograd through
`centroids -> tables` and the centroid updates). The two autograd functions (`_Sums`, `_Output`) have closed-form
backwards and save the weight (a parameter) and each weight's interval (a byte per weight up to 7 bits, else int32),
nothing else weight-sized.

The distance is `|w - c|`, as the paper writes it; the other engines smooth it inside a square root
(`_dkm.DIST_EPS`), which moves the logits by at most `1e-6 / tau` within `1e-6` of a centroid, where the attention is
already one-hot unless two centroids are within a few `tau` (tests/quantization/test_engines.py bounds the difference).
Intervals are found without a search per weight: each weight's cell on a uniform grid of `CELLS` cells per table is
computed once per forward; per step a cell's first interval is a table lookup, then one comparison per centroid
sharing the cell.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_llmkit.compat.torch import sigmoid_slope
from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.quantization._dkm import autocast_off
from hf_llmkit.quantization.engines import interval_kernel

CELLS = 256  # grid cells per table for locating intervals


@dataclass
class Cells:
    """Each weight's cell on a uniform grid of `CELLS` cells over its table's value range (`lo`, `inv_h` `[G, 1]`),
    as a flat index `g CELLS + cell` `[G, n]` (int32)."""

    flat: torch.Tensor
    lo: torch.Tensor
    inv_h: torch.Tensor

    @classmethod
    @torch.no_grad()
    def of(cls, w: torch.Tensor) -> Cells:
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        span = hi - lo
        inv_h = torch.where(span > 0, CELLS / span.clamp_min(torch.finfo(w.dtype).tiny), torch.zeros_like(span))
        cell = cls._cell(w, lo, inv_h)
        if w.shape[0] > 1:
            cell += torch.arange(w.shape[0], device=w.device, dtype=cell.dtype).unsqueeze(1) * CELLS
        return cls(cell.int(), lo, inv_h)

    @staticmethod
    def _cell(v: torch.Tensor, lo: torch.Tensor, inv_h: torch.Tensor) -> torch.Tensor:
        # monotone in v (a subtraction and a positive scale, then floor): v < v' never puts v in a later cell
        return ((v - lo) * inv_h).floor_().clamp_(0, CELLS - 1)

    @torch.no_grad()
    def intervals(self, w: torch.Tensor, sorted_cents: torch.Tensor) -> torch.Tensor:
        """Flat interval index `g (K+1) + j` `[G, n]` (int32) of every weight: `j` = number of centroids `< w`."""
        groups, k = sorted_cents.shape
        c = sorted_cents.to(w.dtype)
        home = self._cell(c, self.lo, self.inv_h).long()  # [G, K], non-decreasing
        per_cell = torch.zeros(groups, CELLS, dtype=torch.int32, device=w.device)
        per_cell.scatter_add_(1, home, torch.ones_like(home, dtype=torch.int32))
        first = per_cell.cumsum(1, dtype=torch.int32) - per_cell  # centroids in earlier cells: all < w in this one
        first += torch.arange(groups, device=w.device, dtype=torch.int32).unsqueeze(1) * (k + 1)
        j = first.view(-1).index_select(0, self.flat.view(-1))
        ext = torch.cat([c, c.new_full((groups, 1), float("inf"))], 1).view(-1)
        w_flat = w.reshape(-1)
        for _ in range(int(per_cell.max())):  # the centroids sharing a weight's cell, compared one by one
            j += (ext.index_select(0, j) < w_flat).int()  # an int32 add (a bool operand takes a slow promoting path)
        return j.view(w.shape)


@dataclass
class Tables:
    """Per-interval tables `[G, K+1]` of sorted centroids (differentiable in them) and the attention weights `P`, `Q`
    of the interval's left and right centroids `[G, K+1, K]`."""

    theta: torch.Tensor  # kappa m_j + l_j: u = sigmoid(theta_j - kappa w), kappa = 2 / tau
    left: torch.Tensor  # P_jk (zero for k >= j)
    right: torch.Tensor  # Q_jk (zero for k < j)
    a: torch.Tensor  # left attention-weighted centroid (0 where there is none)
    b: torch.Tensor  # right one

    @classmethod
    def of(cls, c: torch.Tensor, tau: torch.Tensor) -> Tables:
        """Tables of sorted centroids `c` `[G, K]`, temperature `tau` `[G, 1]`."""
        groups, k = c.shape
        # e^{-|c_a - c_b| / tau}: the left terms of interval j are row j-1's b <= j-1, the right ones row j's b >= j
        near = torch.exp((c.unsqueeze(2) - c.unsqueeze(1)).abs().div_(-tau.unsqueeze(2)))  # [G, K, K]
        below = torch.ones(k, k, dtype=torch.bool, device=c.device).tril()
        pad = c.new_zeros(groups, 1, k)
        e_left, e_right = torch.cat([pad, near * below], 1), torch.cat([near * below.t(), pad], 1)
        big_l, big_r = e_left.sum(2), e_right.sum(2)  # [G, K+1]; >= 1 where not empty
        left = e_left / big_l.clamp_min(1.0).unsqueeze(2)
        right = e_right / big_r.clamp_min(1.0).unsqueeze(2)
        has_l, has_r = big_l > 0, big_r > 0
        inner = has_l & has_r
        logit = torch.where(inner, big_l.clamp_min(1.0).log() - big_r.clamp_min(1.0).log(), 0.0)
        edges = torch.cat([c[:, :1], c], 1) + torch.cat([c, c[:, -1:]], 1)  # c_{j-1} + c_j
        # outer intervals: u is exactly 1 (right of every centroid) or 0, with a zero derivative
        mid = torch.where(inner, 0.5 * edges, torch.where(has_l, float("inf"), float("-inf")))
        theta = 2.0 / tau * mid + logit
        cents = c.unsqueeze(2)
        return cls(theta, left, right, (left @ cents).squeeze(2), (right @ cents).squeeze(2))

    def update(self, c: torch.Tensor, count, s_u, s_uw, s_w) -> torch.Tensor:
        """DKM's k-means step `C <- A^T W / A^T 1` from the per-interval sums `[G, K+1]` (a centroid nobody attends
        keeps its value)."""
        inside = torch.stack([s_u, s_uw], 2)
        res = self.left.transpose(1, 2) @ inside + self.right.transpose(1, 2) @ (torch.stack([count, s_w], 2) - inside)
        den, num = res.unbind(2)  # [G, K]
        return torch.where(den > 1e-30, num / den.clamp_min(1e-30), c)


def _share(w, kappa, j, theta):
    """The left share `u = sigmoid(theta_j - kappa w)` `[G, n]` of every weight from its interval's `theta_j` (one
    gather, one fused multiply-subtract, one sigmoid)."""
    return torch.sigmoid_(theta.index_select(0, j.view(-1)).view_as(w).addcmul_(w, kappa, value=-1.0))


def _pack(j: torch.Tensor, width: int) -> torch.Tensor:
    """What a step saves of the intervals `j` (flat indices `g width + j`, `[G, n]` int32): the local index in one
    byte when it fits (`width = K + 1 <= 256`, up to 7 bits), else `j` itself."""
    if width > 256:
        return j
    local = j if j.shape[0] == 1 else j - _offsets(j, width)
    return local.to(torch.uint8)


def _unpack(saved: torch.Tensor, width: int) -> torch.Tensor:
    if saved.dtype != torch.uint8:
        return saved
    j = saved.int()
    return j if j.shape[0] == 1 else j.add_(_offsets(j, width))


def _offsets(j: torch.Tensor, width: int) -> torch.Tensor:
    return torch.arange(j.shape[0], device=j.device, dtype=j.dtype).unsqueeze(1) * width


class _Sums(torch.autograd.Function):
    """Per-interval `sum u`, `sum u w`, `sum w` (`[3, G (K+1)]`) of one DKM step, differentiable in `w` and the
    intervals' `theta` (flat `[G (K+1)]`); the intervals `j` are given; each weight counted by its importance
    (`weigh()`: `[G, n]`, rebuilt in backward from its factors, or None: 1). Saves the intervals in a byte per weight;
    `u` is recomputed in backward."""

    @staticmethod
    def forward(ctx, w, j, theta, kappa, weigh=None):
        u = _share(w, kappa, j, theta)
        flat = j.view(-1)
        out = w.new_zeros(3, theta.shape[0])
        h = None if weigh is None else weigh()
        if h is not None:
            u.mul_(h)
        out[0].index_add_(0, flat, u.view(-1))
        out[1].index_add_(0, flat, u.mul_(w).view(-1))
        out[2].index_add_(0, flat, w.reshape(-1) if h is None else (h * w).view(-1))
        ctx.save_for_backward(w, _pack(j, theta.shape[0] // w.shape[0]), theta, kappa)
        ctx.weigh = weigh
        return out

    @staticmethod
    @autocast_off
    def backward(ctx, grad):
        w, packed, theta, kappa = ctx.saved_tensors
        j = _unpack(packed, theta.shape[0] // w.shape[0])
        flat = j.view(-1)
        u = _share(w, kappa, j, theta)
        g_u, g_uw, g_w = (grad[i].index_select(0, flat).view_as(w) for i in range(3))
        # d/dw of h (g_u u + g_uw u w + g_w w), with du/d(theta) = u (1 - u) and du/dw = -kappa u (1 - u)
        slope = sigmoid_slope(torch.addcmul(g_u, g_uw, w), u)
        h = None if ctx.weigh is None else ctx.weigh()
        if h is not None:
            slope.mul_(h)
            g_w, g_uw = g_w * h, g_uw * h
        grad_theta = w.new_zeros(theta.shape).index_add_(0, flat, slope.view(-1))
        grad_w = torch.addcmul(g_w, g_uw, u).addcmul_(slope, kappa, value=-1.0)
        return grad_w, None, grad_theta, None, None


class _Output(torch.autograd.Function):
    """DKM's soft weight `b_j + d_j u` `[G, n]`, differentiable in `w` and the intervals' `theta`, `b`, `d`."""

    @staticmethod
    def forward(ctx, w, j, theta, kappa, b, d):
        u = _share(w, kappa, j, theta)
        flat = j.view(-1)
        ctx.save_for_backward(w, _pack(j, theta.shape[0] // w.shape[0]), theta, kappa, d)
        return torch.addcmul(b.index_select(0, flat).view_as(w), d.index_select(0, flat).view_as(w), u)

    @staticmethod
    @autocast_off
    def backward(ctx, grad):
        w, packed, theta, kappa, d = ctx.saved_tensors
        j = _unpack(packed, theta.shape[0] // w.shape[0])
        flat = j.view(-1)
        u = _share(w.detach(), kappa, j, theta)
        grad = grad.reshape(w.shape).to(w.dtype)
        grad_b = w.new_zeros(theta.shape).index_add_(0, flat, grad.view(-1))
        grad_d = w.new_zeros(theta.shape).index_add_(0, flat, (grad * u).view(-1))
        slope = sigmoid_slope(grad, u).mul_(d.index_select(0, flat).view_as(w))  # g d u (1 - u)
        grad_theta = w.new_zeros(theta.shape).index_add_(0, flat, slope.view(-1))
        return slope.mul_(-kappa), None, grad_theta, None, grad_b, grad_d


def soft_dkm(
    w: torch.Tensor, centroids: torch.Tensor, tau: torch.Tensor, iters: int, eps: torch.Tensor, weigh=None
):  # fmt: skip
    """DKM on scalar weights `[G, n]` (float32 or float64): (`A @ C` `[G, n]`, refined centroids `[G, K]`, both in
    `w`'s dtype), differentiable in `w`; `centroids` `[G, K]`, `tau` / `eps` `[G]`; `weigh()` the importance of each
    weight in the k-means steps (`[G, n]`, None: uniform). Iterations stop early like naive DKM's."""
    groups, k = centroids.shape
    cells = Cells.of(w.detach())
    tau = tau.to(w.dtype).view(-1, 1)
    kappa = 2.0 / tau
    c = centroids.to(w.dtype)
    for _ in range(iters):
        cs, order = c.sort(1)
        tables = Tables.of(cs, tau)
        j = cells.intervals(w.detach(), cs)
        mass = None if weigh is None else weigh().reshape(-1)
        count = torch.bincount(j.view(-1), mass, minlength=groups * (k + 1)).to(w.dtype).view(groups, k + 1)
        sums = _Sums.apply(w, j, tables.theta.reshape(-1), kappa, weigh)
        new = torch.empty_like(c).scatter(1, order, tables.update(cs, count, *sums.view(3, groups, k + 1)))
        converged = bool(((new - c).abs().amax(dim=1) <= eps).all())
        c = new
        if converged:
            break
    cs, _ = c.sort(1)
    tables = Tables.of(cs, tau)
    j = cells.intervals(w.detach(), cs)
    flat = [t.reshape(-1) for t in (tables.theta, tables.b, tables.a - tables.b)]
    return _Output.apply(w, j, flat[0], kappa, *flat[1:]), c


def run(x, weight, centroids, settings, group=None, importance=None):
    """The engine interface (see `engines/__init__.py`): `(x @ W_c^T or W_c, refined centroids)`; `importance`
    (`_dkm.Importance`, None: uniform) weighs the k-means steps. Clusters scalars (`cluster_dim=1`), unsharded; 16-bit
    weights compute in float32. On the CPU the C kernel serves (`interval_kernel.py`), elsewhere these torch ops."""
    if interval_kernel.serves(x, weight) and (importance is None or importance.scales is None):
        column = None if importance is None else importance.column  # (scaled weights come to the kernel undivided)
        return interval_kernel.run(x, weight, centroids, settings, importance=column)
    cfg, groups = settings.config, settings.groups
    w = weight.reshape(groups, -1)
    if w.dtype not in (torch.float32, torch.float64):
        w = w.float()
    std = dkm.group_std(w.unsqueeze(-1)).double()
    weigh = None
    if importance is not None:
        rows, dtype = weight.shape[0], w.dtype

        def weigh():
            return importance.dense(rows, groups, dtype)

    out, cents = soft_dkm(w, centroids[..., 0], cfg.temperature * std, cfg.dkm_iters, cfg.epsilon * std, weigh)
    w_c = out.reshape(weight.shape).to(x.dtype if x is not None else weight.dtype)
    return (w_c if x is None else x @ w_c.t()), cents.detach().float().unsqueeze(-1)
