"""Size and bits-per-weight helpers shared by benchmarks/dkm_quickstart.py."""

from __future__ import annotations

from pathlib import Path

import torch


def size_mb(folder: Path) -> float:
    """MiB of the safetensors files in `folder`."""
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors")) / 2**20


def dkm_bits_per_weight(layers) -> float:
    """Bits per weight of DKM layers' compact export (packed indices + tables and block scales, as saved)."""
    bits = sum(t.nbytes * 8 for m in layers for t in m.export().values())
    return bits / sum(m.weight.numel() for m in layers)


def round_to_nearest(model, bits: int, skip: tuple[str, ...] = ()) -> tuple[float, float]:
    """Per-output-channel asymmetric round-to-nearest of every Linear (but those named in `skip`), in place;
    returns (bits/weight, packed bytes) counting an fp16 scale and zero per row."""
    levels, numel, packed = (1 << bits) - 1, 0, 0.0
    with torch.no_grad():
        for name, m in model.named_modules():
            if type(m) is torch.nn.Linear and name not in skip:
                w = m.weight
                lo, hi = w.min(1, keepdim=True).values, w.max(1, keepdim=True).values
                scale = (hi - lo).clamp_min(1e-12) / levels
                w.copy_(((w - lo) / scale).round().clamp(0, levels) * scale + lo)
                numel += w.numel()
                packed += w.numel() * bits / 8 + w.shape[0] * 4
    return packed * 8 / numel, packed


def bf16_latent(model, layer_cls) -> list:
    """Cast every DKM layer's latent weight to bf16 (eDKM's setting) and re-run its k-means; returns the layers."""
    layers = [m for m in model.modules() if isinstance(m, layer_cls)]
    for m in layers:
        m.weight.data = m.weight.data.to(torch.bfloat16)
        m.init_centroids()
    return layers
