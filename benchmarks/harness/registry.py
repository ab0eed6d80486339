"""The registry of the docs fragments `benchmarks/report.py` writes: name -> (results files, render function).

A render function gets {results file name: its JSON} and returns markdown; `measured(...)` is the closing line of
every fragment, `pair` a "min / median". Register one with `@fragment("name", "results_file")` in an area's module
(`areas/<area>/fragments.py`, and `areas/dkm/real_report.py`, `areas/dkm/soft_report.py`); `areas/catalog.py`
imports every such module, and they import this one, never the catalog (tests/benchmarks/test_import_graph.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Fragment:
    files: tuple[str, ...]
    render: Callable[[dict[str, dict]], str]


FRAGMENTS: dict[str, Fragment] = {}


def fragment(name: str, *files: str) -> Callable:
    def register(render: Callable[[dict[str, dict]], str]) -> Callable:
        if name in FRAGMENTS:
            raise ValueError(f"fragment {name!r} is registered twice")
        FRAGMENTS[name] = Fragment(files, render)
        return render

    return register


def measured(data: dict, threads: str | None = None, *, loads_itself: bool = False) -> str:
    """`_Measured <date> by <command>: <machine>; <load>._` from a results file's `recorded` block. A run that loads
    every core itself (`loads_itself`: CI, the suite's workers) was on an idle machine when its load was within the
    core count at the start; the torch of its own environments is in its line, not the measuring process's."""
    rec, load = data["recorded"], data["recorded"]["load_1min"]
    machine = rec["machine"]
    cpu = f" ({machine['cpu']})" if machine.get("cpu") else ""
    gpu = f"GPU {machine['gpu']}" if machine.get("gpu") else "no GPU"
    took = ""
    if rec.get("started"):
        minutes = (datetime.fromisoformat(rec["date"]) - datetime.fromisoformat(rec["started"])).total_seconds() / 60
        took = f" (a run of {max(round(minutes), 1)} min)"
    torch = "" if loads_itself else f", torch {machine['torch']}"
    line = (
        f"_Measured {rec['date']}{took} by `{rec['command']}`: {machine['cores']} cores{cpu}, {gpu}{torch}"
        f"{', ' + threads if threads else ''}; 1-minute load average {load['start']:.1f} at the start, "
        f"{load['mean']:.1f} on average, {load['max']:.1f} at most"
    )
    if loads_itself:
        line += " (the run's own work)"
    if (load["start"] > machine["cores"]) if loads_itself else rec["loaded"]:
        line += " — LOADED MACHINE: the load exceeded the core count, timings are less reliable"
    return line + "._"


def pair(values: list[float], digits: int = 2) -> str:
    """'min / median' of a list."""
    return f"{min(values):.{digits}f} / {statistics.median(values):.{digits}f}"
