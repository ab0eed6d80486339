"""How benchmarks/dkm_inference.py runs its variants: each prepared (quantized, saved) and measured in a process of
its own, the measurements in interleaved rounds with the order rotated each round, every part's variants described by
a dict `spec` (`areas/inference/worker.py` measures one, `areas/inference/variants.py` builds them).

A part survives its peers (`harness/slices.py`): a variant whose preparation or measuring process crashes, fails or
hangs is a row with its one-line reason and every other row is still measured; each row is saved as it is measured (the
part's `save`); with stored rows (`--only-missing`) only the rows missing or recorded loaded are prepared and
measured. Results of parts `loops` and `real` keep one entry per CPU (`save_per_cpu`: a run on another CPU adds its
entry, a run on the same CPU replaces its own, or completes it with --only-missing).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from harness import slices
from harness.common import machine_state, run_record

from areas.inference import worker

PREPARED = ("ours", "bnb", "gptq", "llama_cpp", "onnx")  # the kinds with a checkpoint (or file) made before the rounds
MUST_RUN = ("dense", "ours", "onnx")  # ours and dense must run: the script fails at its end when one did not
HIDDEN = ("dir", "dense_dir", "shape", "text_ids")  # spec keys of this run's folders and inputs, not in the results
PREPARE_TIMEOUT, MEASURE_TIMEOUT = 7200.0, 1800.0


def _context(device: str):
    return multiprocessing.get_context("fork" if device == "cpu" else "spawn")


def prepare_all(specs: list[dict], jobs: int, work: Path, timeout: float = PREPARE_TIMEOUT) -> dict[str, str]:
    """Prepare the checkpoints, `jobs` child processes at a time (started from this thread: no fork from a thread);
    returns {dir: one-line reason} of those that crashed, failed or took more than `timeout` seconds."""
    pending, running, failed = list(specs), [], {}
    while pending or running:
        while pending and len(running) < jobs:
            spec = pending.pop(0)
            out = work / f"prepare-{time.monotonic_ns()}.json"
            process = slices.start_child(worker.run, ("prepare", spec), out, name=f"prepare: {spec['name']}",
                                          context=_context(spec["device"]))  # fmt: skip
            running.append((spec, process, out, time.monotonic()))
        time.sleep(0.5)
        for item in list(running):
            spec, process, out, started = item
            late = time.monotonic() - started > timeout
            if process.is_alive() and not late:
                continue
            running.remove(item)
            got = slices.child_result(process, out, 0 if late else None)
            if "error" in got:
                failed[spec["dir"]] = slices.exit_reason(None, timeout) if late else got["error"]
                print(f"prepare of {spec['name']} failed: {failed[spec['dir']]} (its rows will say so)", flush=True)
    return failed


def child(mode: str, spec: dict, work: Path, timeout: float) -> dict:
    """Run `areas.inference.worker.run` in a child process (a fork on CPU, spawned on CUDA) and return what it wrote; a
    part's own step (its dense checkpoint, kernel table, model folder), so a failure raises with its one line."""
    out = work / f"{mode}-{time.monotonic_ns()}.json"
    got = slices.run_child(worker.run, (mode, spec), out, name=f"{mode}: {spec['name']}", timeout=timeout,
                            context=_context(spec["device"]))  # fmt: skip
    if "error" in got:
        raise RuntimeError(f"{mode} of {spec['name']}: {got['error']}")
    return got


def measure(spec: dict, threads: int, work: Path, failed: dict[str, str], timeout: float = MEASURE_TIMEOUT) -> dict:
    """One row: the variant measured in a fresh process, or its one-line reason (its preparation failed, its process
    crashed, failed or hung)."""
    if spec["dir"] in failed:
        return {"error": f"prepare {failed[spec['dir']]}"}
    out = work / f"measure-{time.monotonic_ns()}.json"
    return slices.run_child(worker.run, ("measure", dict(spec, threads=threads)), out, name=spec["name"],
                             timeout=timeout, context=_context(spec["device"]))  # fmt: skip


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


def _json(value):
    return json.loads(json.dumps(value, default=str))


def reusable(stored: dict | None, specs_out: dict, common: dict) -> dict[str, dict[str, list]] | None:
    """The rows of a stored part entry that this run may keep, per thread count: those of variants whose spec and
    common settings are this run's (None without stored rows: a fresh run measures everything)."""
    if stored is None:
        return None
    if stored.get("common") != _json(common):
        return {}
    same = {n for n, s in specs_out.items() if stored.get("specs", {}).get(n) == _json(s)}
    cells = stored.get("threads", {})
    return {t: {n: rows for n, rows in cell.get("runs", {}).items() if n in same} for t, cell in cells.items()}


def _printed(label: str, threads: int, name: str, r: int, row: dict) -> str:
    if "error" in row:
        return f"[{label}, {threads} thr, round {r + 1}] {name}: {row['error']}"
    tps = statistics.median(row["tokens_per_s_b1"])
    return f"[{label}, {threads} thr, round {r + 1}] {slices.mark(name, row)}: {tps:.1f} tokens/s"


def run_part(
    label: str,
    variants: dict[str, dict],
    common: dict,
    args,
    work: Path,
    threads: list[int],
    rounds: int,
    *,
    stored: dict | None = None,
    save: Callable[[dict], None] | None = None,
) -> dict:
    """Prepare the variants of a part that have rows to measure (those with equal `shares` share one checkpoint),
    then measure them: `rounds` rounds per thread count, each variant a fresh process, `save(part)` after every row.
    `stored` (--only-missing): the part's entry in the results file, whose rows are kept where present."""
    folder = work / label
    specs = {}
    for i, (name, variant) in enumerate(variants.items()):
        shared = variant.get("shares")
        place = f"c{'-'.join(str(k) for k in shared)}" if shared is not None else f"v{i}"
        specs[name] = dict(common, **variant, name=name, dir=str(folder / place))
    specs_out = {n: {k: v for k, v in s.items() if k not in HIDDEN} for n, s in specs.items()}
    names, common_out = list(specs), {k: v for k, v in common.items() if k not in ("dense_dir", "text_ids")}
    kept = reusable(stored, specs_out, common_out)
    todo = {t: slices.to_measure(names, rounds, None if kept is None else kept.get(str(t), {})) for t in threads}
    needed = {name for rows in todo.values() for name, _ in rows}
    print(f"[{label}] {sum(map(len, todo.values()))} of {len(names) * rounds * len(threads)} rows to measure"
          + (f" (--only-missing): {', '.join(n for n in names if n in needed)}" if kept is not None else ""),
          flush=True)  # fmt: skip
    start = time.perf_counter()
    prepare = [s for s in specs.values() if s["kind"] in PREPARED and s["name"] in needed]
    prepare = list({spec["dir"]: spec for spec in prepare}.values())
    print(f"[{label}] preparing {len(prepare)} checkpoints, {args.jobs} at a time", flush=True)
    failed = prepare_all(prepare, args.jobs, work)
    part = {"specs": _json(specs_out), "common": _json(common_out), "threads": {}, "rounds": rounds}
    part["prepare_s"] = time.perf_counter() - start
    if kept is not None:  # --only-missing: the stored cells of other thread counts stay
        part["threads"] = {t: c for t, c in (stored or {}).get("threads", {}).items() if int(t) not in threads}
    with timing_lock():
        for t in threads:
            cell = part["threads"][str(t)] = {"before": machine_state()}

            def on_row(name: str, r: int, runs: dict, t=t, cell=cell) -> None:
                print(_printed(label, t, name, r, runs[name][r]), flush=True)
                cell.update(runs=runs, after=machine_state())
                if save is not None:
                    save(part)

            cell["runs"] = slices.measure_rounds(
                names,
                rounds,
                lambda name, r, t=t: measure(specs[name], t, work, failed),
                stored=None if kept is None else kept.get(str(t), {}),
                on_row=on_row,
            )
            cell["after"] = machine_state()
    return part


def must_run_failures(part: dict) -> list[str]:
    """Rows of dense and ours (which must run) that did not: one line each."""
    kinds = {name: spec["kind"] for name, spec in part["specs"].items()}
    return [
        f"{name} ({threads} thread(s), round {r + 1}): {row['error']}"
        for threads, cell in part["threads"].items()
        for name, rows in cell.get("runs", {}).items()
        for r, row in enumerate(rows)
        if row and "error" in row and kinds.get(name) in MUST_RUN
    ]


def save_per_cpu(name: str, part: dict, argv: list[str]) -> Path:
    """`benchmarks/results/<name>.json` with this run's part under its CPU (`part["cpu"]`), next to the entries of
    other CPUs already there; each entry carries its own run record."""
    entry = {**part, "recorded": run_record(), "argv": argv}
    return slices.update_results(name, {("machines", part["cpu"]): entry})
