"""Benchmarks that survive their peers (issue 49): a variant that crashes, hangs or cannot load is a row with its
one-line reason, rows are saved as they are measured, and a rerun measures only the rows that are still missing.

- `run_child(target, args, out, name=..., timeout=...)` runs `target(*args, out)` in a child process (a fork on CPU)
  that writes its result as JSON to `out`. A crash (any signal, a nonzero exit), a hang past `timeout` or a missing
  result comes back as `{"error": "<one line>"}` (`exit_reason`), never as an exception; the child dies with its
  parent (a benchmark killed mid-run leaves no orphan measuring on). `start_child` / `child_result` are its halves,
  for benchmarks that run several children at once; `run_command` is the same for a fresh interpreter.
- `measure_rounds(names, rounds, measure, stored=..., on_row=...)`: interleaved rounds, the order rotated each round
  (`harness.common.rotated`); each measurement is a row stamped with its own 1-minute load (`stamp`: `load_1min`,
  `cores`, `loaded` where the load exceeded the core count) and its round; an exception from one measurement is that
  row's error. `on_row` runs after every row: the benchmark saves what it has (`update_results`).
- `--only-missing` (`add_only_missing_argument`): the rows a results file holds are passed as `stored`, and only
  the rows missing there or recorded `loaded` are measured (`to_measure`). A loaded timing row is marked in tables
  (`mark`) and used by no verdict (`usable`, `no_verdict`).
- `update_results(name, updates)` sets key paths of `results/<name>.json`, keeping everything else the file holds,
  atomically (a temporary file and `os.replace`, under a lock on the folder), with the run's `recorded` block.

Fault injection: `$HF_LLMKIT_BENCH_CRASH` names variants (several separated by `|`) whose measuring process kills
itself with SIGSEGV before it starts, as a peer's native code would; the tests show with it that such a peer is a
row and the rest of the part is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.common import RESULTS, atomic_write_text, results_name, rotated, run_record

CRASH_ENV = "HF_LLMKIT_BENCH_CRASH"


# -- the load a row was measured at ---------------------------------------------------------------------------------


def load_1min() -> float:
    return round(os.getloadavg()[0], 2)


def stamp(before: float | None = None) -> dict[str, Any]:
    """A row's own load: the 1-minute load average (the higher of `before`, sampled as the row started, and now),
    the core count, `loaded` when the load exceeded the cores, and the time."""
    load = max(before if before is not None else 0.0, load_1min())
    cores = os.cpu_count() or 1
    return {"load_1min": load, "cores": cores, "loaded": load > cores, "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def load_of(rows: list[dict]) -> dict[str, Any]:
    """What a table row made of measured `rows` says of their load: the highest, and `loaded` if any row was (empty
    for rows recorded before rows had loads)."""
    loads = [r for r in rows if r and "load_1min" in r]
    if not loads:
        return {}
    top = max(loads, key=lambda r: r["load_1min"])
    return {"load_1min": top["load_1min"], "cores": top["cores"], "loaded": any(r.get("loaded") for r in loads)}


def usable(row: dict | None) -> bool:
    """A row a verdict may use: measured (no error) on a machine that was not loaded."""
    return bool(row) and "error" not in row and not row.get("loaded")


def mark(label: str, row: dict) -> str:
    """`label` with the loaded mark of `row`, for a table: its timings came from a machine above its core count."""
    if not row.get("loaded"):
        return label
    return f"{label} (LOADED: load {row['load_1min']:.1f} > {row['cores']} cores)"


def no_verdict(name: str, row: dict) -> str:
    """The line a verdict gives instead of a judgement on a loaded row."""
    return (
        f"{name}: no verdict (measured at a 1-minute load of {row['load_1min']:.1f} on {row['cores']} cores: "
        "rerun with --only-missing)"
    )


# -- a variant in a process of its own ------------------------------------------------------------------------------


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:240] if text else ''}".rstrip(": ")


def exit_reason(exitcode: int | None, timeout: float | None = None) -> str:
    """One line for a child that gave no result: killed by a signal, a nonzero exit, or still running at `timeout`
    (`exitcode` None)."""
    if exitcode is None:
        return f"hung: no result within {timeout:.0f} s (killed)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"crashed: killed by {name} (exit {exitcode})"
    return f"failed: exit {exitcode} (its output is above)"


def crash_if_named(name: str) -> None:
    """Fault injection: this (measuring) process dies of SIGSEGV, as a native crash would, where $HF_LLMKIT_BENCH_CRASH
    names `name`; nothing otherwise."""
    if name in {n.strip() for n in os.environ.get(CRASH_ENV, "").split("|") if n.strip()}:
        import faulthandler
        import resource

        faulthandler.disable()  # no Python traceback dump (pytest enables it): the signal's default, as in C
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
        os.kill(os.getpid(), signal.SIGSEGV)


def die_with_parent(parent: int | None = None) -> None:
    """This process gets SIGKILL when the one that started it dies (Linux: PR_SET_PDEATHSIG), so that a benchmark
    killed mid-run leaves no orphan measuring on; exits at once where `parent` already died."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:  # the benchmark died before the line above ran
        os._exit(1)


def _child(target: Callable, args: tuple, name: str, out: str, parent: int) -> None:
    die_with_parent(parent)
    crash_if_named(name)
    target(*args, out)


def start_child(target: Callable, args: tuple, out: Path, *, name: str, context=None):
    """A started child process running `target(*args, str(out))`, which writes its result (JSON) to `out`."""
    context = context or multiprocessing.get_context("fork")
    Path(out).unlink(missing_ok=True)
    process = context.Process(target=_child, args=(target, tuple(args), name, str(out), os.getpid()))
    process.start()
    return process


def child_result(process, out: Path, timeout: float | None = None) -> dict:
    """The result of a child `start_child` started, after waiting up to `timeout` seconds (None: until it ends): the
    JSON it wrote, or `{"error": "<one line>"}` when it crashed, failed, hung (then it is killed) or wrote none."""
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        return {"error": exit_reason(None, timeout)}
    if process.exitcode != 0:
        return {"error": exit_reason(process.exitcode)}
    try:
        return json.loads(Path(out).read_text())
    except (OSError, ValueError) as e:
        return {"error": f"no result: {one_line(e)}"}


def run_child(target: Callable, args: tuple, out: Path, *, name: str, timeout: float, context=None) -> dict:
    """`target(*args, str(out))` in a child process: what it wrote to `out`, or its one-line error (`child_result`)."""
    return child_result(start_child(target, args, out, name=name, context=context), out, timeout)


def run_command(argv: list[str], out: Path, *, timeout: float) -> dict:
    """`argv` as a fresh process (a new interpreter) that writes its result (JSON) to `out`: that result, or its
    one-line error as `child_result` gives it. The script it runs calls `die_with_parent` and `crash_if_named`."""
    import subprocess

    Path(out).unlink(missing_ok=True)
    try:
        done = subprocess.run(argv, timeout=timeout)
    except subprocess.TimeoutExpired:  # subprocess.run killed it
        return {"error": exit_reason(None, timeout)}
    if done.returncode != 0:
        return {"error": exit_reason(done.returncode)}
    try:
        return json.loads(Path(out).read_text())
    except (OSError, ValueError) as e:
        return {"error": f"no result: {one_line(e)}"}


# -- rounds of rows, resumable --------------------------------------------------------------------------------------


def add_only_missing_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--only-missing",
        action="store_true",
        help="measure only the rows the results file lacks or recorded at a load above the core count",
    )


def _padded(rows: list | None, rounds: int) -> list:
    return ([*(rows or [])] + [None] * rounds)[:rounds]


def present(row: dict | None) -> bool:
    """A stored row that a rerun with --only-missing keeps: there (measured or its error) and not loaded."""
    return row is not None and not row.get("loaded")


def to_measure(names: list[str], rounds: int, stored: dict[str, list] | None) -> list[tuple[str, int]]:
    """(name, round index) of every row to measure, in the order they run: all of them without `stored` (a fresh
    run); with it (--only-missing), those missing there or loaded."""
    return [
        (name, r)
        for r in range(rounds)
        for name in rotated(names, r)
        if stored is None or not present(_padded(stored.get(name), rounds)[r])
    ]


def measure_rounds(
    names: list[str],
    rounds: int,
    measure: Callable[[str, int], dict],
    *,
    stored: dict[str, list] | None = None,
    on_row: Callable[[str, int, dict[str, list]], None] | None = None,
) -> dict[str, list]:
    """`rounds` rounds of `measure(name, round_index)` in rotated order (the rows `to_measure` names), each row
    stamped with its load and round; returns {name: [row per round]} (a stored row where none was measured, None
    where there is none). An exception from `measure` is its row's one-line error; `on_row(name, r, runs)` runs
    after every row."""
    runs = {name: _padded(stored.get(name) if stored else None, rounds) for name in names}
    for name, r in to_measure(names, rounds, stored):
        before = load_1min()
        try:
            row = measure(name, r)
        except Exception as e:  # one variant's failure is its row, never the part's
            traceback.print_exc()
            row = {"error": one_line(e)}
        runs[name][r] = {**row, **stamp(before), "round": r + 1}
        if on_row is not None:
            on_row(name, r, runs)
    return runs


# -- the results file, updated in place -----------------------------------------------------------------------------


@contextlib.contextmanager
def _folder_lock(folder: Path):
    import fcntl

    handle = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # closing releases the lock


def kept_sizes(
    name: str, stored: dict, here: dict, config: dict, sizes: list[str], only_missing: bool, *, loose=("rounds",)
) -> dict:
    """The sizes of `stored` (results/<name>.json as read) that a run of `sizes` keeps: every size it does not run,
    and with `--only-missing` the rows of those it runs, when the file was measured here (each key of `here`, e.g.
    the CPU, recorded the same) with these settings (`config`, less the `loose` keys: more rounds keep the rows of
    fewer). A file of another machine or other settings is replaced only by a run of every size it holds; anything
    else stops in one line before measuring, so no size is silently dropped."""
    if not stored.get("sizes"):
        return {}
    settings = {k: v for k, v in config.items() if k not in loose}
    old = {k: v for k, v in stored.get("config", {}).items() if k not in loose}
    if all(stored.get(k) == v for k, v in here.items()) and old == settings:
        return {k: v for k, v in stored["sizes"].items() if only_missing or k not in sizes}
    held = sorted(stored["sizes"])
    if only_missing or set(held) - set(sizes):
        where = ", ".join(f"{k} {stored.get(k) or 'unrecorded'}" for k in here)
        raise SystemExit(
            f"error: {results_path(name)} holds sizes {held} measured with {where} and settings "
            f"{stored.get('config')}, not here or not these: run every size it holds without --only-missing "
            f"(--sizes {' '.join(held)}) to replace it, or move the file away"
        )
    return {}


def results_path(name: str) -> Path:
    return RESULTS / f"{results_name(name)}.json"


def read_results(name: str, path: Path | None = None) -> dict:
    """What `results/<name>.json` holds ({} where there is no file)."""
    path = Path(path) if path is not None else results_path(name)
    return json.loads(path.read_text()) if path.is_file() else {}


def update_results(
    name: str,
    updates: dict[tuple[str, ...], Any],
    *,
    finish: Callable[[dict], None] | None = None,
    path: Path | None = None,
) -> Path:
    """Set each key path of `updates` (`("machines", cpu): entry`) in `results/<name>.json`, keeping everything else
    the file holds; `finish(data)` then completes the whole (verdicts over every entry), and `recorded` is this run's
    record. Atomic under a lock on the folder: a run killed at any moment leaves a whole file."""
    path = Path(path) if path is not None else results_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _folder_lock(path.parent):
        data = read_results(name, path)
        for keys, value in updates.items():
            node = data
            for key in keys[:-1]:
                if node.get(key) is None:
                    node[key] = {}
                if not isinstance(node[key], dict):
                    raise TypeError(f"{path.name}: {key!r} holds no mapping to update")
                node = node[key]
            node[keys[-1]] = value
        if finish is not None:
            finish(data)
        data["recorded"] = run_record()
        atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")
    return path
