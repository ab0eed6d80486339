"""The bucketed engine (32-bit scalar weights, O(|W|) work, `_buckets.py`): its backward and the autograd function.

Reverse mode through DKM's iterations `c_{t+1} = F(sum_i s(w_i; c_t))` and output `o(w_i; c_T)`, with `s = (a, a w)`:

- output:  dL/dw_i += g_i o'(w_i);  dL/dc_T = d/dc sum_i g_i o(w_i; c)
- step t:  lambda_t = dL/d(sums_t) through F;  dL/dw_i += lambda_t . s'(w_i; c_t);
           dL/dc_t = (through F's fallback) + d/dc lambda_t . sum_i s(w_i; c)

Per bucket, `sum_i g_i o(w_i)` needs the moments `sum g, sum g r, sum g r^2` of the output gradient; the centroid
derivatives are closed forms (`_jets.centroid_grad_jets`) over the small per-bucket tables, and the per-weight
terms are polynomials in `r` whose coefficients are summed over all steps: the backward makes two chunked passes
over the weights (moments, then the gradient) plus one to rebuild the soft weight for the input gradient.
"""

from __future__ import annotations

import torch

from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.quantization._dkm import autocast_off
from hf_llmkit.quantization.engines import _buckets as bk
from hf_llmkit.quantization.engines._buckets import Rows, group_sum, per_row, per_row_tau
from hf_llmkit.quantization.engines._grid import Grid, Located, chunks, evaluate, locate
from hf_llmkit.quantization.engines._jets import attention_jets, centroid_grad_jets, combine, times_w


def _grad_moments(loc: Located, grid: Grid, g: torch.Tensor, dtype) -> torch.Tensor:
    """`[3, U]`: `sum g, sum g r, sum g r^2` per bucket of the output gradient `g` `[G, n]`."""
    moments = g.new_zeros(3, grid.rows)
    for sl, row, r in chunks(loc):
        gc = g[:, sl].reshape(-1)
        moments[0].index_add_(0, row, gc)
        gr = gc * r
        moments[1].index_add_(0, row, gr)
        moments[2].index_add_(0, row, gr.mul_(r))
    return moments.to(dtype)


def _output_backward(rows: Rows, cents, tau, need_cents: bool):
    """Output step over rows whose moments are those of the output gradient: (coefficients `[3, R]` of `o'` around
    each row, dL/dc_T `[G, K]` or None). `do/dc_j = a_j + d/dc_j sum_k c_k a_k` (the `c_k` weights held fixed)."""
    groups = cents.shape[0]
    coef = rows.u.new_empty(3, rows.u.shape[0])
    grad_c = cents.new_zeros(cents.shape) if need_cents else None
    for sl, part in rows.split(cents.shape[1]):
        c = per_row(cents, part.gid)
        jets = attention_jets(part.u, c, per_row_tau(tau, part.gid), 3)
        o = combine(jets, c)
        coef[:, sl] = torch.stack([o[1], o[2], 0.5 * o[3]])
        if need_cents:
            q = centroid_grad_jets(jets, c, o, 2)
            weights = [part.moments[0], part.moments[1], 0.5 * part.moments[2]]
            grad_c += group_sum(part.gid, groups, [jets.a[n] + q[n] for n in range(3)], weights)
    return coef, grad_c


def _step_backward(rows: Rows, cents, tau, lam, need_cents: bool):
    """Iteration step over rows (moments of the weights): (coefficients `[3, R]` of `lambda . s'` around each row,
    its part of dL/dc_t `[G, K]` or None)."""
    groups = cents.shape[0]
    coef = rows.u.new_empty(3, rows.u.shape[0])
    grad_c = cents.new_zeros(cents.shape) if need_cents else None
    for sl, part in rows.split(cents.shape[1]):
        u = part.u
        lam_den, lam_num = per_row(lam[:, 0], part.gid), per_row(lam[:, 1], part.gid)
        jets = attention_jets(u, per_row(cents, part.gid), per_row_tau(tau, part.gid), 3)
        f_den, f_num = combine(jets, lam_den), combine(jets, lam_num)  # lambda . a^(n), [R] each
        f = [d + m for d, m in zip(f_den, times_w(f_num, u))]  # jets of lambda . s(w), s = (a, a w)
        coef[:, sl] = torch.stack([f[1], f[2], 0.5 * f[3]])
        if need_cents:
            q_den = centroid_grad_jets(jets, lam_den, f_den, 2)
            q_num = times_w(centroid_grad_jets(jets, lam_num, f_num, 2), u)
            n, s1, s2 = part.moments
            grad_c += group_sum(part.gid, groups, [q_den[i] + q_num[i] for i in range(3)], [n, s1, 0.5 * s2])
    return coef, grad_c


def _with_exact(grid_part, exact_part):
    """Add the exact set's centroid gradient (None-aware)."""
    if grid_part is None or exact_part is None:
        return grid_part
    return grid_part + exact_part


def weight_grad(grid: Grid, loc: Located, stages, sums_all, tau, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """dL/dw `[G, n]` (float32, written over `g`) of DKM's soft weight given its gradient `g` `[G, n]`."""
    g_flat, dtype, last = g.view(-1), tau.dtype, stages[-1]
    need = len(stages) > 1
    moments = grid.moments  # unused without iterations (no centroid gradient needed)
    if need:
        moments = _grad_moments(loc, grid, g, dtype)
        if last.kinks is not None:
            moments[:, last.kinks] = 0.0
    j_table, grad_c = _output_backward(Rows(grid.centers, grid.gid, moments), last.cents, tau, need)
    exact_terms = []  # (flat indices, dL/dw) of weight-by-weight sets
    exact = bk.exact_rows(last, w, dtype)
    if exact is not None:
        j_table[:, last.kinks] = 0.0
        g_exact = g_flat[last.exact].to(dtype)
        exact.moments[0] = g_exact
        coef, grad_ce = _output_backward(exact, last.cents, tau, need)
        grad_c = _with_exact(grad_c, grad_ce)
        exact_terms.append((last.exact, g_exact * coef[0]))
    psi = None  # the iteration steps' per-bucket polynomials, summed over steps
    for t in range(len(stages) - 2, -1, -1):
        stage = stages[t]
        with torch.enable_grad():  # through c_{t+1} = num / den (tiny tensors)
            s = sums_all[t].detach().requires_grad_()
            c0 = stage.cents.detach().requires_grad_()
            lam, grad_direct = torch.autograd.grad(bk.centroid_update(s, c0), (s, c0), grad_c)
        coef, grad_c = _step_backward(bk.grid_rows(grid, stage), stage.cents, tau, lam, t > 0)
        exact = bk.exact_rows(stage, w, dtype)
        if exact is not None:
            coef[:, stage.kinks] = 0.0
            coef_e, grad_ce = _step_backward(exact, stage.cents, tau, lam, t > 0)
            grad_c = _with_exact(grad_c, grad_ce)
            exact_terms.append((stage.exact, coef_e[0]))
        if grad_c is not None:
            grad_c = grad_c + grad_direct
        psi = coef if psi is None else psi + coef
    j_table = j_table.float()
    psi = None if psi is None else psi.float()
    for sl, row, r in chunks(loc):
        gc = g[:, sl]
        term = evaluate(j_table, row, r).view_as(gc).mul_(gc)
        if psi is not None:
            term += evaluate(psi, row, r).view_as(gc)
        g[:, sl] = term
    for index, values in exact_terms:
        g_flat.index_add_(0, index, values.float())
    return g


class BucketedDKM(torch.autograd.Function):
    """`x @ W_c^T` (or `W_c` when `x` is None), `W_c` DKM's soft-clustered 32-bit weight; also the new centroids.

    Inputs: `x`, `weight` `[rows, cols]` float32, `cents` `[G, K]` / `tau`, `eps` `[G]` (float64: the tables' dtype),
    `iters`, `groups`. Saves the layer input, the weight (a parameter) and the small grid/step tables.
    """

    @staticmethod
    def forward(ctx, x, weight, cents, tau, eps, iters, groups):
        w = weight.detach().reshape(groups, -1)
        grid, loc, stages, sums_all, table, exact_out = bk.forward(w, cents, tau, eps, iters)
        w_c = bk.soft_weight(loc, stages[-1], table, exact_out).view(weight.shape)
        del loc
        ctx.layout = (grid.span, len(stages), grid.row_of is None)
        ctx.save_for_backward(x, weight, *_flatten(grid, stages, sums_all, tau, table, exact_out))
        new_cents = stages[-1].cents.float()
        ctx.mark_non_differentiable(new_cents)
        if x is None:
            return w_c, new_cents
        return x @ w_c.to(x.dtype).t(), new_cents

    @staticmethod
    @autocast_off
    def backward(ctx, grad, _grad_cents):
        x, weight, *saved = ctx.saved_tensors
        grid, stages, sums_all, tau, table, exact_out = _unflatten(saved, ctx.layout)
        w = weight.detach().reshape(grid.groups, -1)
        loc = locate(w, grid)
        grad_x = None
        if x is not None:
            if ctx.needs_input_grad[0]:
                w_c = bk.soft_weight(loc, stages[-1], table, exact_out).view(weight.shape)
                grad_x = grad @ w_c.to(x.dtype)
                del w_c
            g = grad.reshape(-1, grad.shape[-1]).t().float() @ x.reshape(-1, x.shape[-1]).float()
        else:
            g = grad.float().clone()
        grad_w = weight_grad(grid, loc, stages, sums_all, tau, w, g.view(grid.groups, -1))
        return grad_x, grad_w.view(weight.shape).to(weight.dtype), None, None, None, None, None


_EMPTY = torch.empty(0)


def _flatten(grid: Grid, stages, sums_all, tau, table, exact_out) -> list[torch.Tensor]:
    """The grid and step state as a flat tensor list for `save_for_backward` (so saved-tensor hooks count it)."""

    def opt(t):
        return _EMPTY if t is None else t

    out = [grid.h, grid.inv_h, grid.kmin, opt(grid.row_of), opt(grid.inverse), grid.centers, grid.gid, grid.moments]
    out += [tau, table, opt(exact_out)]
    for stage in stages:
        out += [stage.cents, opt(stage.kinks), opt(stage.exact)]
    return out + list(sums_all)


def _unflatten(saved, layout):
    span, num_stages, unique = layout
    h, inv_h, kmin, row_of, inverse, centers, gid, moments, tau, table, exact_out = saved[:11]

    def opt(t):
        return None if t.numel() == 0 else t

    grid = Grid(h, inv_h, kmin, span, None if unique else row_of, opt(inverse), centers, gid, moments)
    rest = saved[11:]
    stages = [bk.Stage(rest[3 * i], opt(rest[3 * i + 1]), opt(rest[3 * i + 2])) for i in range(num_stages)]
    return grid, stages, list(rest[3 * num_stages :]), tau, table, opt(exact_out)


def run(x, weight, centroids, settings, group=None):
    """The engine interface (see `engines/__init__.py`): `(x @ W_c^T or W_c, refined centroids)`. Needs finite
    float32 scalar weights (`cluster_dim=1`) and no sharding; `engines.resolve` checks that before calling it."""
    cfg, groups = settings.config, settings.groups
    std = dkm.group_std(dkm.to_vectors(weight, groups, 1))
    tau, eps = (cfg.temperature * std).double(), (cfg.epsilon * std).double()
    result, cents = BucketedDKM.apply(x, weight, centroids[..., 0].double(), tau, eps, cfg.dkm_iters, groups)
    return result, cents.unsqueeze(-1)
