"""Part `loops` of benchmarks/dkm_inference.py: every loop level of the packed layers' CPU kernel that this CPU has,
each forced in turn (`_lut_native.cap_loops`), so that one machine measures its own level and every level below it.

- `kernel_table`: one packed Linear of the issue's MLP shape (2,816 x 1,024) at batch 1, per loop level, bits (2, 3,
  4), block scales (none, 64 columns) and input dtype (bfloat16, float32), against `F.linear` with the dense bf16
  and fp32 weight. Each variant cycles through enough copies of its weight (>= `COLD_BYTES`) that every call reads
  it from memory, as a generating model does; the floor is the time to stream the packed bytes at the bandwidth
  measured here (a sum over a buffer of the same total size). Variants interleaved in rotated rounds, one process.
- `model_plan`: the issue's random Llama (hidden 1,024, 4 layers, MLP 2,816, vocabulary 4,096), batch-1 `generate`
  tokens/s of dense bf16 / fp32 and of ours saved and reloaded at each bits x scales x dtype x loop level, each a
  fresh process per round (`areas.inference.runner.run_part`), ratios per round against dense bf16 and fp32.
"""

from __future__ import annotations

import platform
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from harness.common import Bench, markdown_table
from harness.slices import mark, no_verdict, usable

from areas.inference import switch
from areas.inference.switch import packed_layers

ROWS, COLS = 2816, 1024
COLD_BYTES = 96 * 2**20  # well above the last-level cache of the CPUs measured: every call streams from memory
MODEL = dict(hidden=1024, layers=4, intermediate=2816, vocab=4096, heads=16)
TINY = dict(hidden=128, layers=2, intermediate=384, vocab=4096, heads=4)
DTYPES = ("bfloat16", "float32")
DENSE = ("dense bf16", "dense fp32")  # the bases of the verdicts
PREFILL = 32  # the whole-model rows time generation; their prefill (untabled) is kept short


def cpu_name() -> str:
    """The CPU's model and the vector extensions that decide the kernel's loops, e.g. 'AMD EPYC (AVX2 FMA F16C)'."""
    from harness.common import cpu_model

    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = [("avx512f", "AVX-512"), ("avx512_vbmi", "VBMI"), ("avx512_bf16", "AVX512-BF16"), ("avx2", "AVX2"),
              ("fma", "FMA"), ("f16c", "F16C"), ("asimd", "NEON"), ("sve", "SVE")]  # fmt: skip
    have = [name for flag, name in wanted if flag in flags]
    return f"{cpu_model() or platform.machine()} ({' '.join(have) or 'no vector extensions named'})"


def levels() -> list[str]:
    """The loop levels this CPU runs: each one its kernel can take, from the best down to portable."""
    from hf_llmkit.quantization import _lut_native as native

    return list(native.available_loops())


def _packed(bits: int, block: int, count: int):
    return packed_layers(bits, block, count, ROWS, COLS)


def _copies(nbytes: int, quick: bool) -> int:
    return 2 if quick else max(2, -(-COLD_BYTES // nbytes))


def kernel_table(quick: bool) -> dict:
    """Per-layer seconds of every variant (min / median over rounds) and the streaming floor of its bytes."""
    from hf_llmkit.quantization import _lut_native as native

    variants, nbytes, copies = {}, {}, {}
    for dtype in DTYPES:
        weights = [torch.randn(ROWS, COLS).to(getattr(torch, dtype)) for _ in range(_copies(ROWS * COLS * 4, quick))]
        x = torch.randn(1, COLS).to(getattr(torch, dtype))
        name = f"dense {'bf16' if dtype == 'bfloat16' else 'fp32'} F.linear"
        variants[name] = lambda weights=weights, x=x: [F.linear(x, w) for w in weights]
        nbytes[name], copies[name] = weights[0].numel() * weights[0].element_size(), len(weights)
    for bits in (3,) if quick else (2, 3, 4):
        for block in (0,) if quick else (0, 64):
            size = ROWS * COLS * bits // 8 + (ROWS * COLS // block * 2 if block else 0)
            layers = _packed(bits, block, _copies(size, quick))
            for level in levels():
                for dtype_name in DTYPES:
                    dtype = getattr(torch, dtype_name)
                    x = torch.randn(1, COLS).to(dtype)
                    name = f"{level} {bits}-bit{' scales/64' if block else ''} {dtype_name}"

                    def run(layers=layers, x=x, level=level, dtype=dtype):
                        native.cap_loops(level)
                        for layer in layers:
                            native.gemv(layer, x, dtype, dtype)

                    variants[name], nbytes[name], copies[name] = run, size, len(layers)
    stream = torch.zeros(max(COLD_BYTES, 2**20) // 8, dtype=torch.int64)
    variants["stream"], nbytes["stream"], copies["stream"] = lambda: stream.sum(), stream.numel() * 8, 1
    with torch.inference_mode():
        timings = Bench(rounds=2 if quick else 7, warmup=1).run(variants)
    native.cap_loops(native.LOOPS[-1])
    bandwidth = nbytes["stream"] / min(timings.seconds["stream"])  # bytes/s, the fastest round
    rows = {}
    for name, seconds in timings.seconds.items():
        if name == "stream":
            continue
        per_layer = [s / copies[name] for s in seconds]
        rows[name] = {
            "min_s": min(per_layer),
            "median_s": statistics.median(per_layer),
            "bytes": nbytes[name],
            "floor_s": nbytes[name] / bandwidth,
        }
    return {"shape": [ROWS, COLS], "bandwidth_gb_s": bandwidth / 1e9, "rows": rows, "levels": levels()}


def model_plan(quick: bool) -> dict[str, dict]:
    """The variants of the whole-model measurement: dense bf16 / fp32 and ours per bits x scales x dtype x level."""
    plan = {
        "dense bf16": dict(kind="dense", dtype="bfloat16", bits=16),
        "dense fp32": dict(kind="dense", dtype="float32", bits=32),
    }
    for bits in (3,) if quick else (2, 3, 4):
        for scales in (False,) if quick else (False, True):
            options = dict(lut_dtype="bfloat16", kmeans_iters=5, kmeans_sample=4096)
            options.update(dict(scale_block_size=64) if scales else {})
            for level in levels():
                for dtype in DTYPES:
                    short = "bf16" if dtype == "bfloat16" else "fp32"
                    label = f"ours {bits}-bit{' scales/64' if scales else ''} {short} [{level}]"
                    plan[label] = dict(
                        kind="ours", bits=bits, options=options, dtype=dtype, loops=level, shares=(bits, scales)
                    )
    return plan


def _ratio_vs(summary: dict, name: str, base: str) -> float | None:
    mine, theirs = summary[name], summary.get(base)
    if "error" in mine or not theirs or "error" in theirs:
        return None
    return mine["tokens_per_s_b1"] / theirs["tokens_per_s_b1"]


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def verdicts(part: dict) -> list[str]:
    """Per loop level and variant: ours >= 1.5x dense bf16 and >= dense fp32 in batch-1 tokens/s (the per-round
    ratio for bf16, medians for fp32); rows (or bases) measured on a loaded machine are judged by none; then the
    prefill switch's (`areas/inference/switch.py`)."""

    lines = []
    for threads, cell in part["threads"].items():
        s = cell.get("summary", {})
        where = f"[{part['cpu']}, {threads} thread(s)]"
        for name, v in s.items():
            if v.get("loaded"):
                lines.append(f"{where} {no_verdict(name, v)}")
            if not name.startswith("ours") or not usable(v) or not all(map(usable, map(s.get, DENSE))):
                continue
            fp32 = _ratio_vs(s, name, "dense fp32")
            if v.get("b1_x_bf16") is None or fp32 is None:
                continue
            lines.append(
                f"{where} {name}: {v['b1_x_bf16']:.2f}x dense bf16 "
                f"({'holds' if v['b1_x_bf16'] >= 1.5 else 'FAILS'} >= 1.5), {fp32:.2f}x dense fp32 "
                f"({'holds' if fp32 >= 1 else 'FAILS'} >= 1)"
            )
    return lines + switch.verdicts(part.get("switch"))


def kernel_rows(table: dict) -> str:
    head = mark("loop, weight, inputs", table)  # the table's rows are timed in one process: one load for them all
    rows = [[head, "us per layer (min / median)", "x dense bf16", "x dense fp32", "x stream floor"]]
    r = table["rows"]
    bf16, fp32 = r["dense bf16 F.linear"]["median_s"], r["dense fp32 F.linear"]["median_s"]
    for name, v in r.items():
        rows.append(
            [
                name,
                f"{v['min_s'] * 1e6:,.0f} / {v['median_s'] * 1e6:,.0f}",
                f"{bf16 / v['median_s']:.2f}",
                f"{fp32 / v['median_s']:.2f}",
                f"{v['median_s'] / v['floor_s']:.2f}",
            ]
        )
    return markdown_table(rows)


def model_rows(part: dict, threads: str) -> str:
    s = part["threads"][threads].get("summary", {})
    rows = [["variant [loop]", "tokens/s batch 1", "x dense bf16 (per round)", "x dense fp32", "loops taken"]]
    for name, v in s.items():
        if "error" in v:
            rows.append([name, f"did not run: {v['error']}", "", "", ""])
            continue
        fp32 = _ratio_vs(s, name, "dense fp32")
        tps = f"{v['tokens_per_s_b1']:.1f}"
        rows.append([mark(name, v), tps, _x(v.get("b1_x_bf16")), _x(fp32), v.get("loops", "")])
    return markdown_table(rows)
