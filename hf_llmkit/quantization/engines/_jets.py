"""Closed-form derivatives ("jets") of DKM's scalar soft assignment, in the weight and in the centroids.

For a scalar weight `w` and `K` centroids `c`, DKM's attention is `a_k(w) = softmax_k(z(w))` with
`z_k = -sqrt((w - c_k)^2 + DIST_EPS) / tau`. Writing `y = log a = z - logsumexp(z)`, the derivatives of the
log-sum-exp are the cumulants of `z'` under `a`, so every derivative of `a` has a closed form:

    y'   = z1 - E[z1]
    y''  = z2 - E[z2] - Var[z1]
    y''' = z3 - E[z3] - 3 Cov[z1, z2] - E[(z1 - E z1)^3]
    a' = a y',  a'' = a (y'' + y'^2),  a''' = a (y''' + 3 y' y'' + y'^3)

(`E` is the expectation under `a`, computed with centred values so nothing cancels.) In the centroids: `z_j` depends
on `c_j` only through `w - c_j`, so for `F(w) = sum_k v_k a_k(w)` with `v` fixed, `dF/dc_j = -z1_j a_j (v_j - F)`,
and its derivatives in `w` follow by the product rule.

Layout: tensors are K-major, `[K, R]` for `R` weight values (softmax and sums over K run along dim 0, vectorised
over R; the CPU's softmax over a last dimension of size K is several times slower).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_llmkit.quantization._dkm import DIST_EPS


@dataclass
class Jets:
    """`a[n]` = n-th derivative of the attention, `z[n]` of the logits (`z[0]` unused), each `[K, R]`."""

    a: list[torch.Tensor]
    z: list[torch.Tensor]


def attention_jets(u: torch.Tensor, cents: torch.Tensor, tau: torch.Tensor, order: int) -> Jets:
    """Attention jets up to `order` (0-3) at `w = u` `[R]`, for centroids `[K, R]` (one table per value) or `[K, 1]`.

    `tau` is `[R]` or a scalar tensor.
    """
    if not 0 <= order <= 3:
        raise ValueError(f"order must be 0-3, got {order}")
    x = u - cents  # [K, R]
    d2 = x.square() + DIST_EPS
    d = d2.sqrt()
    inv_tau = 1.0 / tau
    e = torch.exp((d.amin(0, keepdim=True) - d) * inv_tau)  # softmax of -d / tau over K (dim 0)
    a = e / e.sum(0, keepdim=True)
    jets = Jets([a], [d])
    if order == 0:
        return jets

    def mean(v: torch.Tensor) -> torch.Tensor:  # E_a[v] per value, [1, R]
        return (a * v).sum(0, keepdim=True)

    z1 = x / d * -inv_tau
    y1 = z1 - mean(z1)
    jets.a.append(a * y1)
    jets.z.append(z1)
    if order == 1:
        return jets
    y1sq = y1.square()
    inv_d3 = 1.0 / (d2 * d)
    z2 = inv_d3 * (-DIST_EPS * inv_tau)
    z2c = z2 - mean(z2)  # centred
    y2 = z2c - mean(y1sq)
    jets.a.append(a * (y2 + y1sq))
    jets.z.append(z2)
    if order == 2:
        return jets
    z3 = x * inv_d3 / d2 * (3.0 * DIST_EPS * inv_tau)
    y3 = z3 - mean(z3) - 3.0 * mean(y1 * z2c) - mean(y1 * y1sq)
    jets.a.append(a * (y3 + 3.0 * y1 * y2 + y1 * y1sq))
    jets.z.append(z3)
    return jets


def combine(jets: Jets, v: torch.Tensor) -> list[torch.Tensor]:
    """Jets `[R]` of `F(w) = sum_k v_k a_k(w)` for coefficients `v` `[K, R]` or `[K, 1]`."""
    return [(a * v).sum(0) for a in jets.a]


def centroid_grad_jets(jets: Jets, v: torch.Tensor, f: list[torch.Tensor], order: int) -> list[torch.Tensor]:
    """Jets `[K, R]` (up to `order` <= len(jets) - 2) of `dF/dc_j = -z1_j a_j (v_j - F)`, `F = combine(jets, v)`."""
    a, z = jets.a, jets.z
    p = [z[1] * a[0]]  # p = z1 a and its w-derivatives
    if order >= 1:
        p.append(z[2] * a[0] + z[1] * a[1])
    if order >= 2:
        p.append(z[3] * a[0] + 2.0 * z[2] * a[1] + z[1] * a[2])
    e = [v - f[0]] + [-f[n] for n in range(1, order + 1)]  # v - F
    q = [-(p[0] * e[0])]
    if order >= 1:
        q.append(-(p[1] * e[0] + p[0] * e[1]))
    if order >= 2:
        q.append(-(p[2] * e[0] + 2.0 * p[1] * e[1] + p[0] * e[2]))
    return q


def times_w(f: list[torch.Tensor], u: torch.Tensor) -> list[torch.Tensor]:
    """Jets of `f(w) * w` at `w = u` from the jets of `f`: `(f w)^(n) = f^(n) u + n f^(n-1)`."""
    return [f[0] * u] + [f[n] * u + n * f[n - 1] for n in range(1, len(f))]
