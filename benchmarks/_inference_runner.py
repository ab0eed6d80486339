"""How benchmarks/dkm_inference.py runs its variants: each prepared (quantized, saved) and measured in a process of
its own, the measurements in interleaved rounds with the order rotated each round, every part's variants described by
a dict `spec` (`_inference_worker.py` measures one, `_inference_variants.py` builds them), and results that keep one
entry per CPU (`write_per_cpu`: a run on another CPU adds its entry, a run on the same CPU replaces its own).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path

import _inference_worker as worker
from _common import RESULTS, machine_state, results_name, run_record, write_results

PREPARED = ("ours", "bnb", "gptq", "llama_cpp", "onnx")  # the kinds with a checkpoint (or file) made before the rounds


def prepare_all(specs: list[dict], jobs: int, work: Path) -> None:
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


def child(mode: str, spec: dict, work: Path, timeout: float) -> dict:
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
            got = child("measure", dict(specs[name], threads=threads), work, 1800)
            runs[name].append(got)
            tps = f"{statistics.median(got['tokens_per_s_b1']):.1f} tokens/s" if "error" not in got else got["error"]
            print(f"[{size}, {threads} thr, round {r + 1}] {name}: {tps}", flush=True)
            if "error" in got and specs[name]["kind"] in ("dense", "ours", "onnx"):
                raise SystemExit(f"error: {name} failed: {got['error']}")  # ours and dense must run
    return {"runs": runs, "before": before, "after": machine_state()}


def run_part(label: str, variants: dict[str, dict], common: dict, args, work: Path, threads: list[int], rounds: int):
    """Prepare every variant of a part (those with equal `shares` share one checkpoint), then time them: `rounds`
    rounds per thread count, each variant a fresh process."""
    folder = work / label
    specs = {}
    for i, (name, variant) in enumerate(variants.items()):
        shared = variant.get("shares")
        place = f"c{'-'.join(str(k) for k in shared)}" if shared is not None else f"v{i}"
        specs[name] = dict(common, **variant, name=name, dir=str(folder / place))
    start = time.perf_counter()
    todo = list({spec["dir"]: spec for spec in specs.values() if spec["kind"] in PREPARED}.values())
    print(f"[{label}] preparing {len(todo)} checkpoints, {args.jobs} at a time", flush=True)
    prepare_all(todo, args.jobs, work)
    prepare_s = time.perf_counter() - start
    with timing_lock():
        cells = {str(t): run_rounds(label, specs, list(specs), t, rounds, work) for t in threads}
    hidden = ("dir", "dense_dir", "shape", "text_ids")
    specs_out = {n: {k: v for k, v in s.items() if k not in hidden} for n, s in specs.items()}
    return {"specs": specs_out, "threads": cells, "prepare_s": prepare_s, "rounds": rounds}


def write_per_cpu(name: str, part: dict, argv: list[str]) -> Path:
    """`benchmarks/results/<name>.json` with this run's part under its CPU (`part["cpu"]`), next to the entries of
    other CPUs already there; each entry carries its own run record."""
    path = RESULTS / f"{results_name(name)}.json"
    machines = json.loads(path.read_text()).get("machines", {}) if path.is_file() else {}
    machines[part["cpu"]] = {**part, "recorded": run_record(), "argv": argv}
    return write_results(name, {"machines": machines})
