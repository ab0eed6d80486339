"""Every docs fragment `benchmarks/report.py` renders: importing this module registers them all in
`harness.registry.FRAGMENTS` (name -> results files, render function).

A render function gets {results file name: its JSON} and returns markdown; `measured(...)` is the closing line of
every fragment (the date, command, machine and load that the results file recorded, and "LOADED MACHINE" when the
load exceeded the core count during the run). Each area registers its own with `@fragment("name", "results_file")`
in its `fragments` module (the DKM quality sections also in `areas/dkm/real_report.py` and `soft_report.py`); a new
module of fragments is imported here. The GPU check's are here: the CUDA variants of some areas' tables and the
check's own summary.
"""

from __future__ import annotations

from harness.common import markdown_table
from harness.registry import FRAGMENTS, fragment, measured

# each of these modules registers its area's fragments when imported
from areas.dkm import fragments as dkm  # noqa: F401
from areas.dkm import (
    real_report,  # noqa: F401
    soft_report,  # noqa: F401
)
from areas.inference import fragments as inference  # noqa: F401
from areas.jobs import fragments as jobs  # noqa: F401
from areas.parallel import fragments as parallel  # noqa: F401
from areas.peft import fragments as peft  # noqa: F401

__all__ = ["CUDA_VARIANTS", "FRAGMENTS"]

# -- CUDA: the same tables from the GPU check's results (benchmarks/gpu_check.py), rendered in docs/gpu.md -----------

CUDA_VARIANTS = ("moe_layers", "moe_summary", "dkm_speed", "sp_memory", "sp_time", "peft_llama", "quickstart")


def _on_cuda(name: str) -> None:
    """Registers `<name>.cuda`: fragment `name` rendered from the `.cuda` results files (`<file>.cuda.json`)."""
    files, render = FRAGMENTS[name].files, FRAGMENTS[name].render
    fragment(f"{name}.cuda", *(f"{file}.cuda" for file in files))(
        lambda results: render({file: results[f"{file}.cuda"] for file in files})
    )


for _name in CUDA_VARIANTS:
    _on_cuda(_name)


@fragment("gpu_check.cuda", "gpu_check.cuda")
def gpu_check(results: dict) -> str:
    """benchmarks/gpu_check.py: each part's status, seconds and budget in the last GPU check."""
    data = results["gpu_check.cuda"]
    rows = [["part", "status", "seconds", "budget s", "command"]]
    for name, row in data["parts"].items():
        command = f"`{row['command']}`" if row.get("command") else row.get("why", "")
        rows.append([name, row["status"], f"{row['seconds']:.0f}", f"{row['budget_s']:.0f}", command])
    head = f"The parts before the report, {data['seconds']:.0f} s of the check's {data['total_s']:.0f}:\n\n"
    return head + markdown_table(rows) + "\n\n" + measured(data)
