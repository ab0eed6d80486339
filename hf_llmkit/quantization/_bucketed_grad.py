"""Backward of the bucketed 32-bit DKM (`_bucketed.py`) and the autograd function that ties both together.

Reverse mode through DKM's iterations `c_{t+1} = F(sum_i s(w_i; c_t))` and output `o(w_i; c_T)`, with `s = (a, a w)`:

- output:  dL/dw_i += g_i o'(w_i);  dL/dc_T = d/dc sum_i g_i o(w_i; c)
- step t:  lambda_t = dL/d(sums_t) through F;  dL/dw_i += lambda_t . s'(w_i; c_t);
           dL/dc_t = (through F's fallback) + d/dc lambda_t . sum_i s(w_i; c)

Per bucket, `sum_i g_i o(w_i)` needs the moments `sum g, sum g r, sum g r^2` of the output gradient; the centroid
gradients are autograd over the small per-bucket tables (float64), the per-weight terms are polynomials in `r`
whose coefficients are summed over all steps, so the backward touches each weight a handful of times.
"""

from __future__ import annotations

import torch

from hf_llmkit.quantization import _bucketed as bk
from hf_llmkit.quantization._jets import attention_jets, centroid_grad_jets, combine, times_w


def _exact_jets(stage: bk.Stage, tau: torch.Tensor, w_flat: torch.Tensor, per: int):
    """(values `[M]` float64, group `[M]`, centroids `[K, M]`, attention jets to order 1) of the exact set."""
    wv = w_flat[stage.exact].to(tau.dtype)
    g, cents, tau_m = bk.member_params(stage, tau, per)
    return wv, g, cents, attention_jets(wv, cents, tau_m, 1)


def _exact_group_sum(rows: torch.Tensor, g: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-group sum `[G, K]` of per-weight columns `[K, M]`."""
    return rows.new_zeros(rows.shape[0], groups).index_add_(1, g, rows).t()


def _output_backward(grid, stage, tau, w_flat, per, g, row, r, need_cents):
    """Output step: (dL/dw `[N]` float32, dL/dc_T `[G, K]` or None)."""
    groups, gr = stage.cents.shape[0], g * r
    moments = [torch.bincount(row, weights=v, minlength=grid.rows).to(tau.dtype) for v in (g, gr, gr * r)]
    moments[2] = 0.5 * moments[2]
    if stage.kinks is not None:
        for m in moments:
            m[stage.kinks] = 0.0
    cents = bk.per_row(grid, stage.cents)
    jets = attention_jets(grid.centers, cents, bk.per_row_tau(grid, tau), 3)
    o = combine(jets, cents)
    grad_c = None
    if need_cents:  # do/dc_j = a_j + d/dc_j of sum_k c_k a_k with the c_k weights held fixed
        q = centroid_grad_jets(jets, cents, o, 2)
        grad_c = bk.group_sum(grid, [jets.a[n] + q[n] for n in range(3)], moments, groups)
    table = torch.stack([o[1], o[2], 0.5 * o[3]])
    if stage.kinks is not None:
        table[:, stage.kinks] = 0.0
    grad_w = g * bk.evaluate(table.float(), row, r)
    if stage.exact is not None:
        wv, gi, ce, je = _exact_jets(stage, tau, w_flat, per)
        oe = combine(je, ce)
        ge = g[stage.exact].to(tau.dtype)
        grad_w[stage.exact] += (ge * oe[1]).float()
        if need_cents:
            qe = centroid_grad_jets(je, ce, oe, 0)[0]
            grad_c = grad_c + _exact_group_sum((je.a[0] + qe) * ge, gi, groups)
    return grad_w, grad_c


def _step_backward(grid, stage, sums, tau, w_flat, per, grad_next, need_cents):
    """Iteration step: (per-bucket coefficients `[3, U]` of dL/dw, exact dL/dw of its set, dL/dc_t or None)."""
    groups, u = stage.cents.shape[0], grid.centers
    with torch.enable_grad():  # through c_{t+1} = num / den (tiny tensors)
        s = sums.detach().requires_grad_()
        c0 = stage.cents.detach().requires_grad_()
        lam, grad_direct = torch.autograd.grad(bk.centroid_update(s, c0), (s, c0), grad_next)
    lam_den, lam_num = bk.per_row(grid, lam[:, 0]), bk.per_row(grid, lam[:, 1])
    jets = attention_jets(u, bk.per_row(grid, stage.cents), bk.per_row_tau(grid, tau), 3)
    f_den, f_num = combine(jets, lam_den), combine(jets, lam_num)  # lambda . a^(n), [U] each
    f = [d + m for d, m in zip(f_den, times_w(f_num, u))]  # jets of lambda . s(w) = lambda_den . a + lambda_num . a w
    grad_c = None
    if need_cents:
        n, s1, s2 = bk._masked_moments(grid, stage)
        q_den = centroid_grad_jets(jets, lam_den, f_den, 2)
        q_num = times_w(centroid_grad_jets(jets, lam_num, f_num, 2), u)
        grad_c = grad_direct + bk.group_sum(grid, [q_den[i] + q_num[i] for i in range(3)], [n, s1, 0.5 * s2], groups)
    table = torch.stack([f[1], f[2], 0.5 * f[3]])
    if stage.kinks is not None:
        table[:, stage.kinks] = 0.0
    exact = None
    if stage.exact is not None:
        wv, gi, ce, je = _exact_jets(stage, tau, w_flat, per)
        if groups == 1:
            ld, ln = lam[0, 0].unsqueeze(1), lam[0, 1].unsqueeze(1)  # [K, 1]
        else:
            ld, ln = lam[gi, 0].t(), lam[gi, 1].t()  # [K, M]
        fd, fn = combine(je, ld), combine(je, ln)
        exact = fd[1] + fn[1] * wv + fn[0]
        if need_cents:
            qe = centroid_grad_jets(je, ld, fd, 0)[0] + centroid_grad_jets(je, ln, fn, 0)[0] * wv
            grad_c = grad_c + _exact_group_sum(qe, gi, groups)
    return table, exact, grad_c


def weight_grad(grid, stages, sums_all, tau, w, g, row, r) -> torch.Tensor:
    """dL/dw `[G * n]` (float32) of DKM's output given its gradient `g` `[G * n]`."""
    w_flat, per = w.reshape(-1), w.shape[1]
    grad_w, grad_c = _output_backward(grid, stages[-1], tau, w_flat, per, g, row, r, len(stages) > 1)
    coefficients = None
    for t in range(len(stages) - 2, -1, -1):
        table, exact, grad_c = _step_backward(grid, stages[t], sums_all[t], tau, w_flat, per, grad_c, t > 0)
        coefficients = table if coefficients is None else coefficients + table
        if exact is not None:
            grad_w[stages[t].exact] += exact.float()
    if coefficients is not None:
        grad_w += bk.evaluate(coefficients.float(), row, r)
    return grad_w


class BucketedDKM(torch.autograd.Function):
    """`x @ W_c^T` (or `W_c` when `x` is None), `W_c` DKM's soft-clustered 32-bit weight; also the new centroids.

    Inputs: `x`, `weight` `[rows, cols]` float32, `cents` `[G, K]` / `tau`, `eps` `[G]` float64, `iters`, `groups`.
    Saves the layer input, the weight (a parameter) and the small grid/step tables; nothing weight-sized.
    """

    @staticmethod
    def forward(ctx, x, weight, cents, tau, eps, iters, groups):
        w = weight.detach().reshape(groups, -1)
        grid, row, r, stages, sums_all = bk.forward_stages(w, cents, tau, eps, iters)
        last = stages[-1]
        table = bk.output_table(grid, last, tau)
        w_c = bk.evaluate(table, row, r)
        exact_out = None
        if last.exact is not None:
            exact_out = bk.exact_outputs(last, tau, w.reshape(-1), w.shape[1]).float()
            w_c[last.exact] = exact_out
        w_c = w_c.reshape(weight.shape)
        ctx.layout = (groups, grid.span, len(stages), grid.row_of is None)
        ctx.grid_stages = _flatten(grid, stages, sums_all, tau, table, exact_out, row if grid.row_of is None else None)
        ctx.save_for_backward(x, weight, *ctx.grid_stages)
        ctx.grid_stages = None
        new_cents = last.cents.float()
        ctx.mark_non_differentiable(new_cents)
        if x is None:
            return w_c, new_cents
        return x @ w_c.to(x.dtype).t(), new_cents

    @staticmethod
    def backward(ctx, grad, _grad_cents):
        x, weight, *saved = ctx.saved_tensors
        grid, stages, sums_all, tau, table, exact_out, inverse = _unflatten(saved, ctx.layout)
        w = weight.detach().reshape(grid.h.shape[0], -1)
        row, r = bk.locate(w, grid, inverse)
        grad_x = None
        if x is not None:
            if ctx.needs_input_grad[0]:
                w_c = bk.evaluate(table, row, r)
                if exact_out is not None:
                    w_c[stages[-1].exact] = exact_out
                grad_x = grad @ w_c.reshape(weight.shape).to(x.dtype)
                del w_c
            g = grad.reshape(-1, grad.shape[-1]).t().float() @ x.reshape(-1, x.shape[-1]).float()
        else:
            g = grad.float()
        grad_w = weight_grad(grid, stages, sums_all, tau, w, g.reshape(-1), row, r)
        return grad_x, grad_w.reshape(weight.shape).to(weight.dtype), None, None, None, None, None


_EMPTY = torch.empty(0)


def _flatten(grid, stages, sums_all, tau, table, exact_out, inverse) -> list[torch.Tensor]:
    """The grid and step state as a flat tensor list for `save_for_backward` (so saved-tensor hooks see it)."""

    def opt(t):
        return _EMPTY if t is None else t

    out = [grid.h, grid.inv_h, grid.kmin, opt(grid.row_of), grid.centers, grid.gid, grid.moments, tau, table]
    out += [opt(exact_out), opt(inverse)]
    for stage in stages:
        out += [stage.cents, opt(stage.kinks), opt(stage.exact)]
    return out + list(sums_all)


def _unflatten(saved, layout):
    groups, span, num_stages, unique = layout
    h, inv_h, kmin, row_of, centers, gid, moments, tau, table, exact_out, inverse = saved[:11]

    def opt(t):
        return None if t.numel() == 0 else t

    grid = bk.Grid(h, inv_h, kmin, span, None if unique else row_of, centers, gid, moments)
    rest = saved[11:]
    stages = [bk.Stage(rest[3 * i], opt(rest[3 * i + 1]), opt(rest[3 * i + 2])) for i in range(num_stages)]
    sums_all = list(rest[3 * num_stages :])
    return grid, stages, sums_all, tau, table, opt(exact_out), opt(inverse)
