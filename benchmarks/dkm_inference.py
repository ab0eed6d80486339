"""DKM packed inference against dense and the 3-4 bit formats users deploy: `generate` speed, prefill, memory.

    python benchmarks/dkm_inference.py                # the issue's Llama (hidden 1024, 8 layers) and a ~1B shape
    python benchmarks/dkm_inference.py --quick        # a tiny Llama, one round, a few variants: a smoke test
    python benchmarks/dkm_inference.py --threads 1 2  # each thread count its own rounds
    python benchmarks/dkm_inference.py --device cuda  # every variant on the GPU (synchronized timings)

Variants, all from the same random-weight bf16 Llama (details in `_inference_variants.py`): dense fp32 and bf16;
ours, `DKMConfig` at 3 and 4 bits, with and without `scale_block_size=64`, a table per tensor and a table per
output channel (`granularity="per_grouped_channel", group_size=1`), 16-bit tables (from a short k-means: the speed
does not depend on the tables' values), saved and reloaded with
`from_pretrained` (the compact `PalettizedLinear` layers); peers that run here: bitsandbytes nf4, HQQ 3/4-bit g64
(its torch backend), torchao int4 weight-only (where 0.18 has a layout for the device) and intx 3/4-bit g64
weight-only, GPTQ 3/4-bit g64 through gptqmodel (its torch kernel). A peer that cannot run gets its one-line
reason in the results file and the table (`bash benchmarks/install_peers.sh` installs them).

Per variant: batch-1 and batch-8 greedy `generate` tokens/s (new tokens after a short prompt, after a warm-up),
the time of one prefill forward of 512 tokens, the bytes of the tensors the model holds (whole model and decoder
layers) and the peak resident memory (`VmHWM`) of loading and of inference. Each variant runs in a fresh process
per round (its memory its own), the variants in an order rotated each round; ratios to dense bf16 are per round.
Writes benchmarks/results/dkm_inference.json and dkm_inference.png; prints the targets' verdict lines. With
$HF_LLMKIT_BENCH_LOCK naming a file, the timed rounds hold a lock on it (the preparation runs before, unlocked).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _inference_worker as worker
from _common import add_device_argument, machine_state, pick_device, recorded_path, write_results
from _inference_report import plot, print_tables, summarize, verdicts
from _inference_variants import preimport

SHAPES = {
    "tiny": dict(hidden=128, layers=2, intermediate=384, vocab=4096, heads=4),
    "issue": dict(hidden=1024, layers=8, intermediate=2816, vocab=4096, heads=16),
    "1b": dict(hidden=2048, layers=22, intermediate=5632, vocab=32000, heads=32, kv_heads=4),
}
PER_CHANNEL = dict(granularity="per_grouped_channel", group_size=1)


def ours(bits: int, scales: bool, per_channel: bool) -> tuple[str, dict]:
    options = dict(lut_dtype="bfloat16", kmeans_iters=5, kmeans_sample=4096)  # the speed does not depend on the
    options.update(dict(scale_block_size=64) if scales else {})  # tables' values: a short k-means fits them
    options.update(PER_CHANNEL if per_channel else {})
    label = ", ".join(["a table per channel" if per_channel else "a table per tensor"] + ["scales/64"] * scales)
    return f"ours DKM {bits}-bit ({label})", dict(kind="ours", bits=bits, options=options)


DENSE = {
    "dense fp32": dict(kind="dense", dtype="float32", bits=32),
    "dense bf16": dict(kind="dense", dtype="bfloat16", bits=16),
}
PEERS = {
    "bitsandbytes nf4": dict(kind="bnb", bits=4),
    "HQQ 3-bit g64": dict(kind="hqq", bits=3),
    "HQQ 4-bit g64": dict(kind="hqq", bits=4),
    "torchao int4 g64 weight-only": dict(kind="torchao_int4", bits=4),
    "torchao intx 3-bit g64 weight-only": dict(kind="torchao_intx", bits=3),
    "torchao intx 4-bit g64 weight-only": dict(kind="torchao_intx", bits=4),
    "GPTQ 3-bit g64 (gptqmodel)": dict(kind="gptq", bits=3),
    "GPTQ 4-bit g64 (gptqmodel)": dict(kind="gptq", bits=4),
}

ONNX_OPTIONS = dict(lut_dtype="bfloat16", kmeans_iters=5, kmeans_sample=4096)
ONNX = {  # onnxruntime serving the exports (_inference_onnx.py); the standard-op path times 2 tokens per call
    "onnxruntime dense fp32 export": dict(kind="onnx", bits=3, options=ONNX_OPTIONS, onnx_file="dense",
                                          onnx_kernel=False),
    "onnxruntime DKM 3-bit, standard ops": dict(kind="onnx", bits=3, options=ONNX_OPTIONS, onnx_file="packed",
                                                onnx_kernel=False, onnx_tokens=2),
    "onnxruntime DKM 3-bit, our kernel": dict(kind="onnx", bits=3, options=ONNX_OPTIONS, onnx_file="packed",
                                              onnx_kernel=True),
}  # fmt: skip


def plan(size: str, quick: bool) -> dict[str, dict]:
    """The variants run at one size: everything at the issue's size; at ~1B the ones whose preparation fits the
    run (no fp32, no GPTQ: quantizing 1B weights on two CPU cores takes longer than the whole run)."""
    mine = dict(ours(b, s, c) for b in (3, 4) for c in (False, True) for s in (False, True))
    if quick:
        keep = [
            "dense bf16",
            "ours DKM 3-bit (a table per tensor)",
            "ours DKM 4-bit (a table per channel, scales/64)",
            "bitsandbytes nf4",
            "HQQ 4-bit g64",
            "torchao int4 g64 weight-only",
            "GPTQ 4-bit g64 (gptqmodel)",
        ]
        quick_onnx = {k: v for k, v in ONNX.items() if v["onnx_kernel"]}  # dkm_onnx.py --quick runs all three
        return {k: v for k, v in (DENSE | mine | PEERS).items() if k in keep} | quick_onnx
    if size == "issue":  # 6 of the 8 ours cells: each costs minutes to quantize on a shared 2-core machine
        return {k: v for k, v in (DENSE | mine | PEERS).items() if k not in ISSUE_LEFT_OUT} | ONNX
    if size == "1b":
        keep = [
            "dense bf16",
            "ours DKM 3-bit (a table per tensor)",
            "ours DKM 3-bit (a table per tensor, scales/64)",
            "ours DKM 4-bit (a table per tensor)",
            "ours DKM 4-bit (a table per tensor, scales/64)",
            "bitsandbytes nf4",
            "HQQ 3-bit g64",
            "HQQ 4-bit g64",
            "torchao intx 4-bit g64 weight-only",
        ]
        return {k: v for k, v in (DENSE | mine | PEERS).items() if k in keep}
    return DENSE | mine | PEERS


ISSUE_LEFT_OUT = ("ours DKM 3-bit (a table per channel, scales/64)", "ours DKM 4-bit (a table per channel)")
NOT_RUN_AT_1B = {
    "dense fp32": "not run at ~1B: 4.4 GB of fp32 weights, over the per-process memory this shared machine allows",
    "GPTQ 3-bit g64 (gptqmodel)": "not run at ~1B: GPTQ of 1B weights on two CPU cores takes longer than the run",
    "GPTQ 4-bit g64 (gptqmodel)": "not run at ~1B: GPTQ of 1B weights on two CPU cores takes longer than the run",
}


def _prepare_all(specs: list[dict], jobs: int, work: Path) -> None:
    """Prepare the checkpoints, `jobs` child processes at a time (started from this thread: no fork from a thread)."""
    context = multiprocessing.get_context("fork" if specs and specs[0]["device"] == "cpu" else "spawn")
    pending, running = list(specs), []
    while pending or running:
        while pending and len(running) < jobs:
            spec = pending.pop(0)
            out = work / f"prepare-{time.monotonic_ns()}.json"
            child = context.Process(target=worker.run, args=("prepare", spec, str(out)))
            child.start()
            running.append((spec, child, out))
        time.sleep(0.5)
        for item in [r for r in running if not r[1].is_alive()]:
            spec, child, out = item
            running.remove(item)
            if child.exitcode != 0 or not out.exists():
                for _, other, _ in running:
                    other.kill()
                raise RuntimeError(f"prepare of {spec['name']} failed (exit {child.exitcode}; its traceback is above)")


def _worker(mode: str, spec: dict, work: Path, timeout: float) -> dict:
    """Run `_inference_worker.run` in a child process (a fork on CPU, spawned on CUDA) and return what it wrote."""
    out = work / f"{mode}-{time.monotonic_ns()}.json"
    context = multiprocessing.get_context("fork" if spec["device"] == "cpu" else "spawn")
    child = context.Process(target=worker.run, args=(mode, spec, str(out)))
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        raise RuntimeError(f"{mode} of {spec['name']} took more than {timeout:.0f} s")
    if child.exitcode != 0 or not out.exists():
        raise RuntimeError(f"{mode} of {spec['name']} failed (exit {child.exitcode}; its traceback is above)")
    return json.loads(out.read_text())


@contextlib.contextmanager
def timing_lock():
    """Hold the file lock named by $HF_LLMKIT_BENCH_LOCK (if set) around the timed rounds, so that two timing runs on
    a shared machine never overlap; the preparation (quantizing, saving) runs before it, unlocked."""
    path = os.environ.get("HF_LLMKIT_BENCH_LOCK")
    if not path:
        yield
        return
    with open(path, "a") as handle:
        print("waiting for the timing lock", flush=True)
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_rounds(size: str, specs: dict, names: list[str], threads: int, rounds: int, work: Path) -> dict:
    """`rounds` rounds of every variant, each a fresh process, in an order rotated each round."""
    runs: dict[str, list[dict]] = {name: [] for name in names}
    before = machine_state()
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            got = _worker("measure", dict(specs[name], threads=threads), work, 1800)
            runs[name].append(got)
            tps = f"{statistics.median(got['tokens_per_s_b1']):.1f} tokens/s" if "error" not in got else got["error"]
            print(f"[{size}, {threads} thr, round {r + 1}] {name}: {tps}", flush=True)
            if "error" in got and specs[name]["kind"] in ("dense", "ours", "onnx"):
                raise SystemExit(f"error: {name} failed: {got['error']}")  # ours and dense must run
    return {"runs": runs, "before": before, "after": machine_state()}


def run_size(size: str, args, device: str, work: Path) -> dict:
    shape, variants = SHAPES[size], plan(size, args.quick)
    folder = work / size
    dense_dir = folder / "dense"
    common = dict(
        shape=shape,
        dense_dir=str(dense_dir),
        device=device,
        prompt=args.prompt,
        new_tokens=args.new_tokens[size],
        prefill=args.prefill,
        repeats=args.repeats,
    )
    specs = {
        name: dict(v, name=name, dir=str(folder / f"v{i}"), **common) for i, (name, v) in enumerate(variants.items())
    }
    start = time.perf_counter()
    _worker("prepare", dict(common, kind="checkpoint", name="dense checkpoint", dir=str(dense_dir)), work, 3600)
    todo = [spec for spec in specs.values() if spec["kind"] in ("ours", "bnb", "gptq", "onnx")]
    print(f"[{size}] preparing {len(todo)} checkpoints, {args.jobs} at a time", flush=True)
    _prepare_all(todo, args.jobs, work)
    prepare_s = time.perf_counter() - start
    names = list(specs)
    cells = {}
    with timing_lock():
        for threads in args.threads:
            cells[str(threads)] = run_rounds(size, specs, names, threads, args.rounds[size], work)
    skipped = {k: v for k, v in NOT_RUN_AT_1B.items() if size == "1b" and not args.quick}
    specs_out = {n: {k: v for k, v in s.items() if k not in ("dir", "dense_dir", "shape")} for n, s in specs.items()}
    return {
        "shape": shape,
        "specs": specs_out,
        "threads": cells,
        "prepare_s": prepare_s,
        "not_run": skipped,
        "new_tokens": args.new_tokens[size],
        "rounds": args.rounds[size],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, one round, a few variants")
    parser.add_argument("--sizes", nargs="*", choices=list(SHAPES), default=None, help="(default: issue 1b)")
    parser.add_argument("--threads", nargs="*", type=int, default=[1], help="torch threads (default: 1)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds at the issue's size (~1B: one round fewer)")
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats per process, after a warm-up")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated (~1B: a quarter)")
    parser.add_argument("--prefill", type=int, default=512, help="tokens of the prefill forward")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens before generating")
    parser.add_argument("--jobs", type=int, default=2, help="checkpoints prepared at once (untimed; default: 2)")
    add_device_argument(parser)
    args = parser.parse_args()
    device = pick_device(args.device).type
    if min([*args.threads, args.rounds, args.repeats, args.new_tokens, args.jobs]) < 1:
        parser.error("--threads, --rounds, --repeats, --new-tokens and --jobs must be at least 1")
    sizes = args.sizes or (["tiny"] if args.quick else ["issue", "1b"])
    if args.quick:
        args.new_tokens, args.prefill, args.prompt, args.rounds = 4, 32, 8, 1
    args.rounds = {s: max(1, args.rounds - (s == "1b")) for s in SHAPES}
    args.new_tokens = {s: max(1, args.new_tokens // (4 if s == "1b" else 1)) for s in SHAPES}
    started = time.perf_counter()
    results: dict = {
        "argv": sys.argv[1:],
        "device": device,
        "config": {"prompt": args.prompt, "prefill": args.prefill, "repeats": args.repeats, "threads": args.threads},
    }
    if device == "cpu":
        results["preimported"] = preimport()  # once, for every forked child
    with tempfile.TemporaryDirectory(prefix="dkm_inference_") as tmp:
        results["sizes"] = {size: run_size(size, args, device, Path(tmp)) for size in sizes}
    for size in results["sizes"].values():
        summarize(size)
    results["verdicts"] = verdicts(results)
    results["seconds"] = time.perf_counter() - started
    print_tables(results)
    print("\n" + "\n".join(results["verdicts"]))
    path = plot(results)
    results["plots"] = [recorded_path(path)] if path else []
    out = write_results("dkm_inference", results)
    print(f"\nwrote {out} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
