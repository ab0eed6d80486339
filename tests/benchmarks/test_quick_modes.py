"""Every benchmark script's `--quick` mode runs to completion on CPU (`--device cpu`, the same code that runs on
CUDA with `--device cuda`) and writes its JSON with the run's date, machine and load, from which every docs
fragment of that script renders (benchmarks/report.py); results go to a temporary folder
($HF_LLMKIT_BENCH_RESULTS). The scripts are the ones `make bench` runs: files in benchmarks/ not starting with `_`
that have a `__main__` block, except the four in NOT_RUN_ALONE.

Each quick mode runs once per test run (tests/benchmarks/conftest.py), and every test that reads its results reads
that run: the GPU check's plumbing mode passes `--quick` to some of its parts (`IN_PLUMBING`), and its run of those
scripts is their quick run here (with the GPU run's flags too, which the scripts must take).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402
import report  # noqa: E402

NOT_RUN_ALONE = {
    "adapterhub_peer.py": "peft_methods.py runs it inside the AdapterHub virtual environment, with a JSON spec",
    "ci_time.py": "a fresh-clone CI run: ~25 minutes of every core, run alone (no --quick, no --device)",
    "report.py": "not a measurement: renders the docs' regions from the results files",
    "gpu_check.py": "runs the others on a GPU; its CPU plumbing mode: tests/benchmarks/test_gpu_check.py",
}

# dkm.py and lm_data_memory.py take seconds; the others tens of seconds to minutes on 2 busy cores, and the cases
# read from the GPU check's plumbing run wait for it (marked slow: `make test` runs them, `make test-fast` does not)
CASES = {
    "dkm.py": ("dkm.json", pytest.mark.slow),
    # the peers: benchmarks/install_peers.sh; the steps and soft sections write dkm_soft.json
    "dkm_quality.py": (("dkm_quality.json", "dkm_soft.json"), pytest.mark.slow),
    # a fresh process per variant and round; its parts write a file each (the first is the script's main one)
    "dkm_inference.py": (tuple(f"dkm_inference{part}.json" for part in ("", "_loops", "_real")), pytest.mark.slow),
    "dkm_onnx.py": ("dkm_onnx.json", pytest.mark.slow),  # two exports, a fresh process per variant
    "lm_data_memory.py": ("lm_data_memory.json", ()),  # one short line
    "moe.py": ("moe.json", pytest.mark.slow),
    "callbacks.py": ("callbacks.json", pytest.mark.slow),
    "peft_methods.py": ("peft_methods.json", pytest.mark.slow),
    "quickstart.py": ("quickstart.json", pytest.mark.slow),
    "sequence_parallel.py": ("sequence_parallel.json", pytest.mark.slow),
}
# the scripts whose GPU check part passes `--quick` in the plumbing mode: that run is their quick run
IN_PLUMBING = {f"{part.name}.py": part for part in gpu_check.PARTS if "--quick" in part.cpu}


def check_dkm_inference(data: dict) -> None:
    """Ours ran through the compact `PalettizedLinear` layers; every other variant ran or records why not (a peer
    that is not installed is a row with its reason)."""
    summary = data["sizes"]["tiny"]["threads"]["1"]["summary"]
    ours = {name: row for name, row in summary.items() if name.startswith("ours")}
    assert ours and all(row["module"] == "PalettizedLinear" for row in ours.values()), ours
    assert all(row["decoder_weights_x_bf16"] < 0.5 for row in ours.values()), ours
    for name, row in summary.items():
        assert ("error" in row and row["error"].strip()) or row["tokens_per_s_b1"] > 0, (name, row)
    assert summary["dense bf16"]["decoder_weights_x_bf16"] == 1.0
    assert any(line.startswith("[tiny, 1 thread] 3-bit") for line in data["verdicts"]), data["verdicts"]


def check_dkm_inference_parts(results: Path) -> None:
    """Parts loops and real: every loop level this CPU has, named with the CPU in every row's results; the real
    model's rows ran through our packed layers (or say why not), llama.cpp's too."""
    loops = json.loads((results / "dkm_inference_loops.json").read_text())["machines"]
    (cpu, part), *_ = loops.items()
    levels = part["kernels"]["levels"]
    assert levels[-1] == "portable" and ("AVX2" in cpu or "NEON" in cpu) or levels == ["portable"], (cpu, levels)
    summary = part["threads"]["1"]["summary"]
    assert {name.split("[")[-1].rstrip("]") for name in summary if name.startswith("ours")} == set(levels)
    assert all(row["loops"].startswith("DKM kernel") for name, row in summary.items() if name.startswith("ours"))
    switch = part["switch"]  # the prefill switch: every shape, dtype, path and token count timed, and judged
    assert len(switch["seconds"]) == len(switch["shapes"]) * len(switch["tokens"]) * 5 and all(
        s > 0 for s in switch["seconds"].values()
    ), switch
    assert any(line.startswith("[prefill switch]") for line in part["verdicts"]), part["verdicts"]
    real = json.loads((results / "dkm_inference_real.json").read_text())["machines"][cpu]["threads"]["1"]["summary"]
    ours = [row for name, row in real.items() if name.startswith("ours")]
    assert ours and all("8-bit" in row["loops"] and row["kernel_ms_per_token"] > 0 for row in ours), real
    assert all("error" in row or row["tokens_per_s_b1"] > 0 for row in real.values()), real


CHECKS = {"dkm_inference.py": check_dkm_inference}  # what a script's quick results must show beyond the common
FILE_CHECKS = {"dkm_inference.py": check_dkm_inference_parts}  # checks that read the other files a script wrote


def entry_points() -> set[str]:
    """The benchmark scripts, found as `make bench` finds them."""
    scripts = {p.name for p in BENCHMARKS.glob("[!_]*.py") if '\nif __name__ == "__main__":' in p.read_text()}
    return scripts - set(NOT_RUN_ALONE)


def test_every_benchmark_script_has_a_quick_mode_case_and_make_bench_finds_them_the_same_way():
    assert entry_points() == set(CASES)
    makefile = (BENCHMARKS.parent / "Makefile").read_text()
    recipe = makefile[makefile.index("\nbench:") :].split("\n\n")[0]
    assert "grep -l '^if __name__ == \"__main__\":' benchmarks/[!_]*.py" in recipe
    assert all(name in recipe for name in NOT_RUN_ALONE)


def quick_results(request, script: str, files: tuple[str, ...], folder: Path) -> tuple[Path, str]:
    """(the folder of the script's quick results, the command that made them). A script the plumbing run ran has
    its results named as on a GPU (`<name>.cuda.json`): they are copied into `folder` under the names a CPU run
    gives them, which its fragments read."""
    if script not in IN_PLUMBING:
        run = request.getfixturevalue("quick_run")(script)
        run.check()
        return run.folder, f"python benchmarks/{script} --quick --device cpu"
    run = request.getfixturevalue("plumbing_run")
    part = IN_PLUMBING[script]
    row = json.loads((run.folder / "out" / "summary.json").read_text())["parts"][part.name]
    log = (run.folder / "out" / f"{part.name}.log").read_text()
    assert row["status"] == "ok", log[-3000:]
    for file in files:
        shutil.copy(run.folder / "results" / file.replace(".json", ".cuda.json"), folder / file)
    return folder, "python " + row["command"]


@pytest.mark.parametrize(
    ("script", "written"),
    [pytest.param(script, written, id=script[:-3], marks=marks) for script, (written, marks) in CASES.items()],
)
@pytest.mark.timeout(1800)  # a run another worker makes is waited for
def test_quick_mode_runs_to_completion_on_cpu(request, tmp_path, script, written):
    files = (written,) if isinstance(written, str) else written
    results, command = quick_results(request, script, files, tmp_path)
    assert "--quick" in command.split() and "--device cpu" in command, command
    data = json.loads((results / files[0]).read_text())
    recorded = data["recorded"]
    assert recorded["command"] == command
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", recorded["date"])
    assert recorded["machine"]["cores"] and recorded["load_1min"]["max"] >= 0
    CHECKS.get(script, lambda data: None)(data)
    FILE_CHECKS.get(script, lambda folder: None)(results)
    # every docs fragment made from this script's results renders from what the script writes today
    for name, fragment in report.FRAGMENTS.items():
        if len(fragment.files) == 1 and f"{fragment.files[0]}.json" in files:
            assert "_Measured " in report.render(name, results=results), name
