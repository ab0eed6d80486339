"""benchmarks/common.py's device pieces on CPU: the device pick (and its one-line refusal), synchronisation hooks,
the peak-memory meter, and `Bench` calling its sync around each timing."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from harness import common  # noqa: E402

NO_CUDA = not torch.cuda.is_available()


def test_device_argument_defaults_to_what_is_present_and_refuses_others():
    parser = argparse.ArgumentParser()
    common.add_device_argument(parser)
    assert parser.parse_args([]).device == ("cpu" if NO_CUDA else "cuda")
    assert parser.parse_args(["--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", "tpu"])
    assert common.pick_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is present")
def test_cuda_without_a_gpu_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        common.pick_device("cuda")
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --device cuda: torch sees no CUDA device here; use --device cpu"


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is present")
def test_a_script_asked_for_cuda_without_a_gpu_stops_before_any_work():
    from tests import warm  # `python benchmarks/moe.py --device cuda`, forked from the warm interpreter

    proc = warm.run_script(BENCHMARKS / "moe.py", ["--device", "cuda"], timeout=120)
    assert proc.returncode == 2 and "--device cuda: torch sees no CUDA device" in proc.stderr
    assert proc.stdout == ""


def test_cpu_has_nothing_to_synchronize_and_bench_calls_the_sync_it_is_given():
    assert common.synchronizer("cpu") is None
    common.synchronize("cpu")  # a no-op, not an error
    calls = []
    timings = common.Bench(rounds=2, warmup=1, sync=lambda: calls.append(1)).run({"a": lambda: None})
    assert len(timings.seconds["a"]) == 2
    assert len(calls) == 2 * 3  # before and after each of the 3 calls (1 warm-up + 2 timed)


def test_peak_memory_on_cpu_counts_the_tensors_the_block_creates():
    keep = torch.zeros(1 << 20)  # existed before: not counted
    with common.PeakMemory("cpu") as mem:
        a = torch.ones(1 << 18)  # 1 MiB
        b = torch.ones(1 << 18)  # 1 MiB, both alive
        del a, b
        c = torch.ones(1 << 17)  # 0.5 MiB after they were freed
    assert mem.peak_bytes == 2 * (1 << 20)
    assert keep.numel() and c.numel()


def test_machine_state_names_the_gpu_when_there_is_one():
    state = common.machine_state()
    assert state["gpu"] == (None if NO_CUDA else torch.cuda.get_device_name())
    assert "GPU" not in common.load_note(state, state) or not NO_CUDA


def test_results_carry_date_command_machine_and_the_load_over_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/moe.py", "--quick"])
    path = common.write_results("x", {"value": 1}, path=tmp_path / "sub" / "x.json")
    data = json.loads(path.read_text())
    recorded = data.pop("recorded")
    assert data == {"value": 1}
    assert recorded["command"] == "python benchmarks/moe.py --quick"
    assert len(recorded["date"]) == len("2026-01-01 00:00")
    assert recorded["machine"]["cores"] == os.cpu_count() and recorded["machine"]["torch"] == torch.__version__
    load = recorded["load_1min"]
    assert load["samples"] >= 1 and min(load["start"], load["end"]) <= load["mean"] <= load["max"]
    assert recorded["loaded"] == (load["max"] > os.cpu_count())


def test_a_benchmark_script_samples_the_load_over_its_run_and_a_test_importing_the_module_does_not():
    assert common._SAMPLER is None  # imported by pytest: no thread
    code = (  # a process running a script of benchmarks/, as `python benchmarks/moe.py` does
        f"import sys; sys.argv[0] = {str(BENCHMARKS / 'any.py')!r}; sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        "import json; from harness import common; print(json.dumps(common.run_record()))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    recorded = json.loads(proc.stdout)
    assert recorded["started"] and recorded["load_1min"]["samples"] >= 2  # at import, (every 10 s,) at the end
