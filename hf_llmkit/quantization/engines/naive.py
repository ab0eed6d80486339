"""The naive engine: DKM exactly as the paper writes it (Cho et al., ICLR 2022), autograd through `[G, n, K]` maps.

DKM's soft assignment is the attention `A = softmax(-dist(W, C) / tau)`; a few differentiable k-means steps
`C <- A^T W / A^T 1` refine the centroids, and the layer uses `A @ C`. Every tensor here is `[G, n, K]`-sized
(O(|W| |C|) memory), which the other engines avoid; in float64 it is the reference they are tested against.
"""

from __future__ import annotations

import torch

from hf_llmkit.quantization import _dkm as dkm


def soft_dkm(
    vectors: torch.Tensor,
    centroids: torch.Tensor,
    tau: torch.Tensor,
    iters: int,
    eps: torch.Tensor,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive DKM: returns (`A @ C` `[G, n, d]`, refined centroids `[G, K, d]`), differentiable in `vectors`.

    `tau` and `eps` are per group (`[G]`). The centroid iterations stop early when no centroid moves more than
    `eps`. Computes in float32 (float64 for float64 input: the reference the other engines are tested against).
    `importance` `[G, n]` (a constant) weighs each vector in the k-means steps, `C <- A^T H W / A^T H 1`.
    """
    dtype = torch.promote_types(vectors.dtype, torch.float32)
    w = vectors.to(dtype)
    c = centroids.to(dtype)
    scale = tau.view(-1, 1, 1)
    h = None if importance is None else importance.detach().to(dtype).unsqueeze(-1)  # [G, n, 1]
    for _ in range(iters):
        attn = torch.softmax(-dkm.distance(w, c) / scale, dim=-1)  # [G, n, K]
        mass = attn if h is None else attn * h
        num = mass.transpose(1, 2) @ w  # [G, K, d]
        den = mass.sum(1).unsqueeze(-1)  # [G, K, 1]
        new = torch.where(den > 1e-30, num / den.clamp_min(1e-30), c)
        moved = ((new - c).abs().amax(dim=(1, 2)) <= eps).all()
        c = new
        if bool(moved):
            break
    attn = torch.softmax(-dkm.distance(w, c) / scale, dim=-1)
    return attn @ c, c


def run(x, weight, centroids, settings, group=None, importance=None):
    """The engine interface (see `engines/__init__.py`): `(x @ W_c^T or W_c, refined centroids)`; `importance`
    (`_dkm.Importance`, None: uniform) weighs the k-means steps."""
    cfg = settings.config
    vec = dkm.to_vectors(weight, settings.groups, settings.cluster_dim)
    std = dkm.group_std(vec)
    h = None
    if importance is not None:
        h = importance.dense(weight.shape[0], settings.groups, torch.float32).reshape(vec.shape[:2])
    out, cents = soft_dkm(vec, centroids, cfg.temperature * std, cfg.dkm_iters, cfg.epsilon * std, h)
    w_c = out.reshape(weight.shape).to(x.dtype if x is not None else weight.dtype)
    return (w_c if x is None else x @ w_c.t()), cents.detach()
