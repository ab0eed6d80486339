"""Measure one DKM forward/backward: bytes saved for backward, peak resident memory, time.

Used by `benchmarks/dkm.py` (also on `hf_llmkit.testing.launch` ranks, for the sharded cases) and handy to size a
layer before training: `measure_layer(4096, 11008, uniquify=True)`.
"""

from __future__ import annotations

import threading
import time

import psutil
import torch

from hf_llmkit.quantization.layers import DKMLinear, DKMSettings
from hf_llmkit.quantization.marshal import MarshalHooks


class PeakRSS:
    """Peak resident set size above the level at entry, sampled every millisecond by a background thread."""

    def __init__(self, interval: float = 0.001):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def __enter__(self) -> PeakRSS:
        self._proc = psutil.Process()
        self.base = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss - self.base)
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss - self.base)


def measure_layer(
    rows: int,
    cols: int,
    *,
    rows_used: int | None = None,
    uniquify: bool = True,
    shard: bool = False,
    marshal: bool = True,
    bits: int = 3,
    dtype: str = "bfloat16",
    tokens: int = 16,
    dkm_iters: int = 3,
    seed: int = 0,
) -> dict[str, float]:
    """One training forward + backward of a `[rows_used, cols]` slice of a `[rows, cols]` DKM Linear.

    Returns `saved_bytes` (each saved tensor counted separately, or each storage once when `marshal`),
    `peak_bytes` (resident-memory peak above the start of the step), `seconds`, all for the slice; parameters
    and the input activation are not counted (they exist without DKM too).
    """
    rows_used = rows_used or rows
    torch.manual_seed(seed)
    weight = (torch.randn(rows_used, cols) * 0.02).to(getattr(torch, dtype))
    settings = DKMSettings(
        bits=bits, cluster_dim=1, groups=1, uniquify=uniquify, shard=shard, offload=False, dkm_iters=dkm_iters
    )
    layer = DKMLinear(cols, rows_used, False, settings, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
    del weight
    layer.init_centroids()
    layer.train()
    x = torch.randn(tokens, cols).to(layer.weight.dtype)
    # The layer's own hooks are off; an outer meter with the same bookkeeping measures both accountings.
    with PeakRSS() as peak:
        start = time.perf_counter()
        with MarshalHooks(offload=False, exclude=(x,)) as meter:
            y = layer(x)
        y.float().square().sum().backward()
        seconds = time.perf_counter() - start
    stats = meter.stats
    return {
        "saved_bytes": float(stats.stored_bytes if marshal else stats.requested_bytes),
        "requested_bytes": float(stats.requested_bytes),
        "stored_bytes": float(stats.stored_bytes),
        "peak_bytes": float(peak.peak),
        "seconds": seconds,
        "rows_used": float(rows_used),
    }


def measure_cases(cases: list[dict]) -> list[dict[str, float]]:
    """`measure_layer(**case)` for each case, in order (a `launch`-able entry point for benchmarks)."""
    return [measure_layer(**case) for case in cases]
