"""One measuring method for every benchmark: warm-up, interleaved rounds in rotated order, min and median of
per-round ratios, threads and machine load recorded, a markdown table, JSON and a PNG plot in `benchmarks/results/`
(committed: `benchmarks/report.py` renders the docs' numbers from those files).

Times on a shared machine drift with the load, so a benchmark compares variants *within* each round (all variants
run back to back, the order rotated each round so none always runs first or last) and reports the min and the
median of the per-round ratios. The load average before and after is part of every result; a run whose load
exceeded the number of cores says so under its table.

    from harness.common import Bench, machine_state, write_results

    bench = Bench(rounds=7, warmup=1)
    timings = bench.run({"ours": step_ours, "peer": step_peer}, baseline="peer")
    print(timings.table(title="step time"))
    write_results("name", {"timings": timings.to_json()})   # + `recorded`: date, command, machine, load over the run

Devices: every benchmark takes `--device {cpu,cuda}` (`add_device_argument`; default cuda when available) and gets a
`torch.device` from `pick_device`. On CUDA, timings synchronize (`Bench(sync=synchronizer(device))`, or
`synchronize(device)` around hand-made timings) and memory is the allocator's peak (`PeakMemory`:
`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, above what was allocated at entry); on CPU
`PeakMemory` counts the tensors the block creates (`harness.tensor_memory.TensorMemory`), the same quantity without an
allocator. `--quick` (every benchmark has it) runs the smallest sizes for 1-2 rounds: a smoke test in seconds.

A variant in a process of its own (a peer's native code can crash or hang): `harness/slices.py`, rows saved as
measured, a crash a row with its reason, `--only-missing` to resume.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# $HF_LLMKIT_BENCH_RESULTS moves the output (tests run the scripts' --quick modes into a temporary folder)
HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the scripts' folder, the root of these imports
RESULTS = Path(os.environ.get("HF_LLMKIT_BENCH_RESULTS") or HERE / "results")
REPO = HERE.parent


def recorded_path(path: str | os.PathLike) -> str:
    """A path as a committed results file records it: relative to the repository, else its name alone (never an
    absolute path of the machine that ran the benchmark)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else resolved.name


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """`--device {cpu,cuda}`, default cuda when a CUDA device is present."""
    import torch

    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default, help=f"(default: {default})")


def pick_device(name: str) -> torch.device:
    """The `torch.device` for `--device`; exits with code 2 and one line when CUDA is asked for but absent."""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: torch sees no CUDA device here; use --device cpu", file=sys.stderr)
        raise SystemExit(2)
    if name not in ("cpu", "cuda"):
        print(f"error: --device must be cpu or cuda, got {name!r}", file=sys.stderr)
        raise SystemExit(2)
    _PICKED["device"] = name
    return torch.device(name)


_PICKED: dict[str, str] = {}  # the device this process's benchmark picked (`pick_device`)


def results_name(name: str) -> str:
    """The results file stem for `name`: `<name>.cuda` when this run picked `--device cuda` (or
    `$HF_LLMKIT_BENCH_TAG` names a tag: the GPU check's CPU plumbing mode), so GPU results sit beside the CPU ones
    (`<name>.json`) instead of over them."""
    tag = os.environ.get("HF_LLMKIT_BENCH_TAG") or ("cuda" if _PICKED.get("device") == "cuda" else "")
    return f"{name}.{tag}" if tag else name


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously); nothing to wait for on CPU."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def synchronizer(device: torch.device | str) -> Callable[[], None] | None:
    """`Bench(sync=...)` for `device`: None on CPU (nothing to wait for)."""
    import torch

    device = torch.device(device)
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


class PeakMemory:
    """Peak bytes allocated inside the block above what was allocated at entry (`with PeakMemory(device) as mem:`,
    then `mem.peak_bytes`): CUDA's `max_memory_allocated` on a GPU, the tensors the block created on CPU."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        import torch

        self.device = torch.device(device)
        self.peak_bytes = 0
        self._counter = None

    def __enter__(self) -> PeakMemory:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from harness.tensor_memory import TensorMemory

            self._counter = TensorMemory().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            self._counter.__exit__(*exc)
            self.peak_bytes = self._counter.peak_bytes


def machine_state() -> dict[str, Any]:
    """Threads torch uses, the core count, the 1-minute load average and the GPU (if any), to store next to a
    measurement."""
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "load_1min": round(os.getloadavg()[0], 2),
        "time": time.strftime("%Y-%m-%d %H:%M"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def cpu_model() -> str | None:
    """The CPU's model name (Linux `/proc/cpuinfo`; `platform.processor()` elsewhere), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


class LoadSampler:
    """The 1-minute load average every `interval` seconds on a daemon thread, from import to exit: a run's load
    is its maximum and mean over the whole run, not two snapshots. Started at import in the process that runs a
    benchmark script (not in the ranks a benchmark spawns, nor in tests that import this module)."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.started = time.strftime("%Y-%m-%d %H:%M")
        self.samples = [os.getloadavg()[0]]
        threading.Thread(target=self._run, name="load-sampler", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.interval)
            self.samples.append(os.getloadavg()[0])


def _running_a_benchmark() -> bool:
    """This process runs a script of benchmarks/ itself (not a test importing this module, not a spawned rank)."""
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    return multiprocessing.parent_process() is None and script is not None and script.parent == HERE


_SAMPLER = LoadSampler() if _running_a_benchmark() else None


def run_record() -> dict[str, Any]:
    """What a results file says about its run: finish date, start, command, machine (cores, CPU, torch threads,
    GPU, torch version) and the 1-minute load average (start, end, max, mean of the samples) with `loaded`: the
    load exceeded the core count at some point (timings less reliable; memory and quality do not depend on it)."""
    import torch

    samples = [*(_SAMPLER.samples if _SAMPLER else []), os.getloadavg()[0]]  # without a sampler: the load now
    cores = os.cpu_count() or 1
    script = Path(sys.argv[0])
    name = f"benchmarks/{script.name}" if script.suffix == ".py" else script.name
    command = " ".join(["python", name, *sys.argv[1:]])
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "started": _SAMPLER.started if _SAMPLER else None,
        "command": command,
        "machine": {
            "cores": cores,
            "cpu": cpu_model(),
            "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__,
        },
        "load_1min": {
            "start": round(samples[0], 2),
            "end": round(samples[-1], 2),
            "max": round(max(samples), 2),
            "mean": round(statistics.fmean(samples), 2),
            "samples": len(samples),
        },
        "loaded": max(samples) > cores,
    }


def load_note(before: dict[str, Any], after: dict[str, Any]) -> str:
    """One line for under a table: threads, load before/after, and a warning when the machine was overloaded."""
    note = (
        f"torch threads {before['torch_threads']}, {before['cores']} cores, load {before['load_1min']:.2f} -> "
        f"{after['load_1min']:.2f} ({before['time']})"
    )
    if before.get("gpu"):
        note += f", GPU {before['gpu']}"
    if max(before["load_1min"], after["load_1min"]) > (before["cores"] or 1):
        note += " — LOADED MACHINE: load above the core count, ratios less reliable"
    return note


@dataclass
class Timings:
    """Per-variant seconds per round, and per-round ratios against a baseline variant."""

    seconds: dict[str, list[float]]
    baseline: str | None
    before: dict[str, Any]
    after: dict[str, Any]
    ratios: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.baseline is not None:
            base = self.seconds[self.baseline]
            self.ratios = {name: [t / b for t, b in zip(ts, base)] for name, ts in self.seconds.items()}

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, ts in self.seconds.items():
            row = {"min_s": min(ts), "median_s": statistics.median(ts), "rounds": len(ts)}
            if name in self.ratios:
                row.update(ratio_min=min(self.ratios[name]), ratio_median=statistics.median(self.ratios[name]))
            out[name] = row
        return out

    def table(self, *, title: str = "variant") -> str:
        """Markdown: min / median seconds and, with a baseline, min / median of the per-round ratios."""
        ratio_head = f" x {self.baseline} (min / median)" if self.baseline else ""
        rows = [[title, "min s", "median s"] + ([ratio_head.strip()] if ratio_head else [])]
        for name, s in self.summary().items():
            row = [name, f"{s['min_s']:.4g}", f"{s['median_s']:.4g}"]
            if ratio_head:
                row.append(f"{s['ratio_min']:.3f} / {s['ratio_median']:.3f}")
            rows.append(row)
        return markdown_table(rows) + "\n\n" + load_note(self.before, self.after)

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "seconds": self.seconds,
            "baseline": self.baseline,
            "machine_before": self.before,
            "machine_after": self.after,
        }


@dataclass
class Bench:
    """Times callables in interleaved rounds: `warmup` untimed rounds, then `rounds` timed ones.

    Each round runs every variant once, in an order rotated by one each round. `repeat` calls per timing (for
    very short callables) are averaged. `sync` runs after each call (e.g. `torch.cuda.synchronize`).
    """

    rounds: int = 7
    warmup: int = 1
    repeat: int = 1
    sync: Callable[[], None] | None = None

    def run(self, variants: dict[str, Callable[[], Any]], *, baseline: str | None = None) -> Timings:
        if baseline is not None and baseline not in variants:
            raise ValueError(f"baseline {baseline!r} is not one of the variants {sorted(variants)}")
        names = list(variants)
        seconds: dict[str, list[float]] = {name: [] for name in names}
        before = machine_state()
        for round_index in range(self.warmup + self.rounds):
            for name in rotated(names, round_index):
                elapsed = self._time(variants[name])
                if round_index >= self.warmup:
                    seconds[name].append(elapsed)
        return Timings(seconds, baseline, before, machine_state())

    def _time(self, fn: Callable[[], Any]) -> float:
        if self.sync is not None:  # work queued before the timing is not this call's
            self.sync()
        start = time.perf_counter()
        for _ in range(self.repeat):
            fn()
            if self.sync is not None:
                self.sync()
        return (time.perf_counter() - start) / self.repeat


def rotated(names: list[str], round_index: int) -> list[str]:
    """The order of round `round_index`: `names` rotated by one more each round (none always first or last)."""
    shift = round_index % len(names) if names else 0
    return names[shift:] + names[:shift]


def markdown_table(rows: list[list[str]]) -> str:
    """Rows of strings (the first is the header) as an aligned markdown table."""
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_results(name: str, data: dict[str, Any], *, path: str | Path | None = None) -> Path:
    """`benchmarks/results/<name>.json` (`<name>.cuda.json` on CUDA: `results_name`; committed;
    `$HF_LLMKIT_BENCH_RESULTS` moves the folder, `path` the file), with `recorded`: the date, command, machine and
    the load over the whole run (`run_record`)."""
    path = Path(path) if path is not None else RESULTS / f"{results_name(name)}.json"
    atomic_write_text(path, json.dumps({**data, "recorded": run_record()}, indent=2, default=str) + "\n")
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`: a run killed mid-write leaves the
    old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def plot_lines(
    name: str,
    series: dict[str, tuple[list[float], list[float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    logy: bool = False,
    hline: float | None = None,
) -> Path | None:
    """`benchmarks/results/<name>.png` (`<name>.cuda.png` on CUDA): one line per series ({label: (xs, ys)}); None
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no plot for {name}: `pip install matplotlib`, part of the bench extra)")
        return None
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:  # one slow system would otherwise flatten every other line
        ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, name)


def save_figure(fig: Any, name: str, dpi: int = 110) -> Path:
    """`benchmarks/results/<name>.png` from a matplotlib figure (laid out tightly), which is then closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{results_name(name)}.png"
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
