"""eDKM on CUDA: the uniquified (and offloaded) bf16 layer gives naive DKM's output and gradients within bf16
rounding, with a fraction of its GPU memory (`torch.cuda.max_memory_allocated`); k-means init runs on the GPU.

CPU counterparts: tests/quantization/test_dkm_math.py (uniquified == naive) and test_marshal.py (offload).
"""

from __future__ import annotations

import pytest
import torch

from hf_llmkit.quantization.layers import DKMLinear, DKMSettings

pytestmark = pytest.mark.gpu


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def dkm_step(*, device: str, uniquify: bool, offload: bool, rows: int = 1024, cols: int = 1024):
    """One training forward + backward of a bf16 3-bit DKM Linear; (output, weight gradient, peak bytes above the
    start of the step: CUDA's allocator peak on a GPU, None on CPU)."""
    torch.manual_seed(0)
    settings = DKMSettings.build(rows, bits=3, uniquify=uniquify, offload=offload, epsilon=1e-9)
    layer = DKMLinear(cols, rows, False, settings, device=device, dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.02)
    layer.init_centroids()
    assert layer.centroids.device.type == torch.device(device).type
    layer.train()
    x = torch.randn(16, cols, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=torch.bfloat16)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    y = layer(x)
    y.float().square().sum().backward()
    peak = None
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
    return y.detach().float().cpu(), layer.weight.grad.float().cpu(), peak


def test_edkm_equals_naive_dkm_on_cuda_with_a_fraction_of_its_memory():
    y0, g0, naive_peak = dkm_step(device="cuda", uniquify=False, offload=False)
    y1, g1, edkm_peak = dkm_step(device="cuda", uniquify=True, offload=False)
    y2, g2, offload_peak = dkm_step(device="cuda", uniquify=True, offload=True)
    for y, g in ((y1, g1), (y2, g2)):
        assert rel(y, y0) < 2e-2 and rel(g, g0) < 5e-2  # bf16: about one rounding step apart (2.1e-2 on CPU)
    assert g0.abs().sum() > 0
    # naive DKM holds [|W|, 8] soft assignments per iteration (tens of MiB here); the unique-value table a few KiB
    assert edkm_peak < naive_peak / 10, (edkm_peak, naive_peak)
    assert offload_peak <= edkm_peak * 1.05 + 2**20, (offload_peak, edkm_peak)  # saved tensors wait on the host
