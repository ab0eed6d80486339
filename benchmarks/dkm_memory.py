"""Section (c) of benchmarks/dkm.py: memory of naive DKM vs each eDKM technique on LLaMA-7B-shaped layers.

`measure_layer` runs one DKM forward/backward and reports bytes saved for backward, peak resident memory and time
(also on `hf_llmkit.testing.launch` ranks, for the sharded cases); handy to size a layer before training:
`measure_layer(4096, 11008, uniquify=True)`. `memory_cases` runs every case of the section in fresh interpreters.

Cases whose memory is O(|W||C|) (naive, marshal only, shard only) run on a slice of rows and are scaled to the full
layer: every tensor they save is [n, K]- or [n]-shaped, so saved bytes are exactly linear in rows (checked by
measuring two slice sizes; peaks are scaled the same way, approximately). Sharded cases run on 2 gloo ranks (rank 0
reported). MALLOC_MMAP_THRESHOLD_ is set so freed memory is returned and peaks are comparable.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
from harness.common import PeakMemory, synchronize

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
    device: str = "cpu",
) -> dict[str, float]:
    """One training forward + backward of a `[rows_used, cols]` slice of a `[rows, cols]` DKM Linear on `device`.

    Returns `saved_bytes` (each saved tensor counted separately, or each storage once when `marshal`),
    `peak_bytes` (resident-memory peak above the start of the step on CPU; CUDA's `max_memory_allocated` above it
    on a GPU), `seconds`, all for the slice; parameters and the input activation are not counted (they exist
    without DKM too).
    """
    rows_used = rows_used or rows
    torch.manual_seed(seed)
    weight = (torch.randn(rows_used, cols) * 0.02).to(getattr(torch, dtype))
    settings = DKMSettings.build(
        rows_used, bits=bits, uniquify=uniquify, shard=shard, offload=False, dkm_iters=dkm_iters
    )
    if device.startswith("cuda") and torch.distributed.is_initialized():
        device = f"cuda:{torch.cuda.current_device()}"  # a launched rank: its own GPU
    layer = DKMLinear(cols, rows_used, False, settings, device=device, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
    del weight
    layer.init_centroids()
    layer.train()
    x = torch.randn(tokens, cols).to(device=device, dtype=layer.weight.dtype)
    # The layer's own hooks are off; an outer meter with the same bookkeeping measures both accountings.
    with PeakRSS() if layer.weight.device.type == "cpu" else PeakMemory(layer.weight.device) as peak:
        start = time.perf_counter()
        with MarshalHooks(offload=False, exclude=(x,)) as meter:
            y = layer(x)
        y.float().square().sum().backward()
        synchronize(layer.weight.device)
        seconds = time.perf_counter() - start
    stats = meter.stats
    return {
        "saved_bytes": float(stats.stored_bytes if marshal else stats.requested_bytes),
        "requested_bytes": float(stats.requested_bytes),
        "stored_bytes": float(stats.stored_bytes),
        "peak_bytes": float(peak.peak if isinstance(peak, PeakRSS) else peak.peak_bytes),
        "seconds": seconds,
        "rows_used": float(rows_used),
    }


def measure_cases(cases: list[dict]) -> list[dict[str, float]]:
    """`measure_layer(**case)` for each case, in order (a `launch`-able entry point for benchmarks)."""
    return [measure_layer(**case) for case in cases]


SHAPES = [(4096, 4096), (4096, 11008)]
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "OMP_NUM_THREADS": "1",
    # the measuring ranks import this module from the benchmarks folder
    "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")])),
}


def _case_list(naive_rows: int, shapes: list[tuple[int, int]]) -> tuple[list, list]:
    single, sharded = [], []
    for rows, cols in shapes:
        base = {"rows": rows, "cols": cols, "dtype": "bfloat16"}
        single += [
            ((rows, cols), "naive", dict(base, uniquify=False, marshal=False, rows_used=naive_rows)),
            (
                (rows, cols),
                "naive, 2x slice (linearity check)",
                dict(base, uniquify=False, marshal=False, rows_used=2 * naive_rows),
            ),
            ((rows, cols), "marshal only", dict(base, uniquify=False, marshal=True, rows_used=naive_rows)),
            ((rows, cols), "uniquify only", dict(base, uniquify=True, marshal=False)),
            ((rows, cols), "uniquify + marshal", dict(base, uniquify=True, marshal=True)),
        ]
        sharded += [
            (
                (rows, cols),
                "shard only (2 ranks)",
                dict(base, uniquify=False, shard=True, marshal=False, rows_used=naive_rows),
            ),
            (
                (rows, cols),
                "all: uniquify + shard + marshal (2 ranks)",
                dict(base, uniquify=True, shard=True, marshal=True),
            ),
        ]
    return single, sharded


def memory_cases(naive_rows: int, *, device: str = "cpu", shapes: list[tuple[int, int]] | None = None) -> list[dict]:
    """Every case of section (c): two fresh interpreters (single-rank cases) plus a pair of ranks (gloo, or one GPU
    each over NCCL; on CUDA with fewer than 2 GPUs the sharded cases are left out, said so on stderr)."""
    from hf_llmkit.testing import distributed_backend, launch

    single, sharded = _case_list(naive_rows, shapes or SHAPES)
    single = [(shape, name, dict(case, device=device)) for shape, name, case in single]
    sharded = [(shape, name, dict(case, device=device)) for shape, name, case in sharded]
    got = launch(
        measure_cases, [c for *_, c in single], nprocs=1, init_process_group=False, env=MALLOC_ENV, timeout=1200
    )[0]
    if device == "cuda" and "nccl" not in distributed_backend(2):
        print("(c): sharded cases need 2 GPUs on --device cuda; left out", file=sys.stderr)
        sharded = []
    if sharded:
        got += launch(measure_cases, [c for *_, c in sharded], nprocs=2, env=MALLOC_ENV, timeout=1200)[0]
    out, naive = [], {}
    order = shapes or SHAPES
    cases = sorted(zip(single + sharded, got), key=lambda item: order.index(item[0][0]))
    for ((rows, cols), name, _case), res in cases:
        scale = rows / res["rows_used"]
        saved, peak = res["saved_bytes"] * scale, res["peak_bytes"] * scale
        ref = naive.setdefault((rows, cols), (saved, peak))
        out.append(
            {
                "layer": f"{rows}x{cols}",
                "case": name,
                "saved": saved,
                "peak": peak,
                "saved_ratio": ref[0] / max(saved, 1.0),
                "peak_ratio": ref[1] / max(peak, 1.0),
                "measured": f"{int(res['rows_used'])} rows, x{scale:g}" if scale != 1 else "full layer",
                "seconds": res["seconds"],
                "raw": res,
            }
        )
    return out


def print_memory(rows: list[dict]) -> None:
    def ratio(x: float) -> str:
        return f"{x:,.0f}x" if x >= 10 else f"{x:.2f}x"

    def mb(x: float) -> str:
        return f"{x / 2**20:,.1f}"

    print("\n### (c) eDKM techniques: memory of one fwd+bwd, bf16 weights, 3 bits (saved = bytes held for backward)\n")
    print("| layer | case | saved MB | naive/case | peak MB | naive/case | measured on | sec |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(
            f"| {r['layer']} | {r['case']} | {mb(r['saved'])} | {ratio(r['saved_ratio'])} | {mb(r['peak'])} | "
            f"{ratio(r['peak_ratio'])} | {r['measured']} | {r['seconds']:.2f} |"
        )
