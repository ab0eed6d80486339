"""Benchmarks that survive their peers (benchmarks/slices.py, issue 49): a variant whose process crashes, fails,
hangs or writes nothing is a row with its one-line reason; rows are saved as they are measured, atomically; a
benchmark killed mid-run resumes with `--only-missing`, which measures only the rows missing or recorded loaded."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TOY = Path(__file__).resolve().parent / "slices_toy.py"
sys.path.insert(0, str(BENCHMARKS))

from harness import slices  # noqa: E402


def _writes(value, out: str) -> None:
    Path(out).write_text(json.dumps({"value": value}))


def _aborts(out: str) -> None:
    import faulthandler
    import resource

    faulthandler.disable()  # pytest's traceback dump: noise here
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()


def _exits(out: str) -> None:
    os._exit(3)


def _hangs(out: str) -> None:
    time.sleep(60)


def _writes_nothing(out: str) -> None:
    pass


def test_a_child_that_crashes_fails_hangs_or_writes_nothing_is_a_row_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setenv(slices.CRASH_ENV, "peer A | peer B")

    def run(target, args=(), name="x", timeout=30.0):
        return slices.run_child(target, args, tmp_path / f"{name}.json", name=name, timeout=timeout)

    assert run(_writes, (7,)) == {"value": 7}
    assert run(_aborts) == {"error": "crashed: killed by SIGABRT (exit -6)"}
    assert run(_exits) == {"error": "failed: exit 3 (its output is above)"}
    assert run(_hangs, timeout=1) == {"error": "hung: no result within 1 s (killed)"}
    assert run(_writes_nothing)["error"].startswith("no result: FileNotFoundError")
    # $HF_LLMKIT_BENCH_CRASH: the named variants' processes die as a native crash would, the others run
    assert run(_writes, (1,), name="peer B") == {"error": "crashed: killed by SIGSEGV (exit -11)"}
    assert run(_writes, (1,), name="peer C") == {"value": 1}


def test_an_exception_of_one_measurement_is_its_row_and_the_rounds_go_on():
    def measure(name: str, r: int) -> dict:
        if name == "b" and r == 1:
            raise RuntimeError("peer b lost its weights\nsecond line")
        return {"value": r}

    seen = []
    runs = slices.measure_rounds(["a", "b", "c"], 2, measure, on_row=lambda name, r, runs: seen.append((name, r)))
    assert seen == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1)]  # the order rotated each round
    assert runs["b"][1]["error"] == "RuntimeError: peer b lost its weights"
    assert [row["value"] for row in runs["a"]] == [0, 1] and runs["c"][1]["round"] == 2
    assert all({"load_1min", "cores", "loaded", "time"} <= set(row) for rows in runs.values() for row in rows)


def test_only_missing_measures_the_rows_missing_or_loaded():
    stored = {
        "a": [{"value": 1, "loaded": False}, {"value": 2, "loaded": True}],
        "b": [{"error": "crashed: killed by SIGSEGV (exit -11)", "loaded": False}],
        "c": [{"value": 3}, None],  # a row from before rows had their own load counts as measured
    }
    todo = slices.to_measure(["a", "b", "c"], 2, stored)
    assert todo == [("b", 1), ("c", 1), ("a", 1)]  # round 2 in its rotated order
    assert len(slices.to_measure(["a", "b", "c"], 2, None)) == 6  # without --only-missing: every row
    loaded = {"value": 1, "load_1min": 3.5, "cores": 2, "loaded": True}
    assert slices.mark("ours", loaded) == "ours (LOADED: load 3.5 > 2 cores)" and slices.mark("ours", {}) == "ours"
    assert not slices.usable(loaded) and slices.usable({"value": 1, "loaded": False})
    assert slices.load_of([{"load_1min": 1.0, "cores": 2, "loaded": False}, loaded, None])["loaded"]


def test_results_are_updated_in_place_keeping_what_the_file_holds(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"machines": {"other CPU": {"rows": 1}}, "note": "kept"}))
    slices.update_results("x", {("machines", "this CPU"): {"rows": 2}}, path=path)
    count = lambda data: data.update(n=len(data["machines"]))  # noqa: E731
    slices.update_results("x", {("machines", "this CPU", "rows"): 3}, finish=count, path=path)
    data = json.loads(path.read_text())
    assert data["machines"] == {"other CPU": {"rows": 1}, "this CPU": {"rows": 3}} and data["note"] == "kept"
    assert data["n"] == 2 and data["recorded"]["load_1min"]["samples"] >= 1
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]  # no temporary file left


def _running_in_group(group: int) -> list[int]:
    """The processes of a process group that still run (a zombie waits for its reaper: it runs nothing)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _rows(results: Path) -> dict[tuple[str, int], dict]:
    runs = json.loads((results / "toy.json").read_text())["runs"]
    return {(name, r): row for name, rows in runs.items() for r, row in enumerate(rows) if row is not None}


def test_a_part_killed_mid_run_keeps_its_rows_a_crashed_peer_is_a_row_and_only_missing_resumes(tmp_path):
    """The toy benchmark (tests/benchmarks/slices_toy.py: 4 variants x 3 rounds, each row a fresh process, one of
    them crashing with SIGSEGV) is killed with SIGKILL once 3 rows are saved; the rerun with --only-missing measures
    exactly the rows missing (or recorded loaded) and keeps the others."""
    results, work = tmp_path / "results", tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, HF_LLMKIT_BENCH_RESULTS=str(results), PYTHONUNBUFFERED="1", TOY_SECONDS="0.2")
    env[slices.CRASH_ENV] = "crasher"
    command = [sys.executable, str(TOY), "--work", str(work)]
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and first.poll() is None:
            try:
                if len(_rows(results)) >= 3:
                    break
            except (OSError, ValueError, KeyError):  # not written yet (a whole file or none: never half of one)
                pass
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
    finally:
        time.sleep(0.5)
        orphans = _running_in_group(first.pid)  # its measuring child died with it (PR_SET_PDEATHSIG)
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
    assert first.returncode == -signal.SIGKILL, first.stdout.read()
    assert not orphans
    saved = _rows(results)
    assert 3 <= len(saved) < 12, saved
    assert saved[("crasher", 0)]["error"] == "crashed: killed by SIGSEGV (exit -11)"  # the crash is a row
    assert saved[("alpha", 0)]["value"] == 5 and saved[("beta", 0)]["value"] == 4  # the rows before it were kept
    # the rows' own loads decide what the rerun measures; pin two of them so that both cases are shown on a machine
    # whatever its load: alpha's first row recorded on an idle machine (kept), beta's on a loaded one (measured again)
    data = json.loads((results / "toy.json").read_text())
    data["runs"]["alpha"][0]["loaded"], data["runs"]["beta"][0]["loaded"] = False, True
    data["runs"]["crasher"][0]["loaded"] = False
    (results / "toy.json").write_text(json.dumps(data))
    saved = _rows(results)
    everything = [(name, r) for r in range(3) for name in ("alpha", "beta", "crasher", "gamma")]
    expected = [key for key in everything if not slices.present(saved.get(key))]

    rerun = subprocess.run([*command, "--only-missing"], env=env, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    lines = rerun.stdout.splitlines()
    ran = {(line.split()[1], int(line.split()[3]) - 1) for line in lines if line.startswith("measuring ")}
    assert ran == set(expected) and ("beta", 0) in ran and ("alpha", 0) not in ran and ("crasher", 0) not in ran
    assert {tuple(row) for row in json.loads(lines[0].removeprefix("to measure: "))} == set(expected)
    final = _rows(results)
    assert len(final) == 12
    for key, row in final.items():
        if key in saved and key not in ran:
            assert row == saved[key]  # kept as the killed run saved it
        assert row["error"] == "crashed: killed by SIGSEGV (exit -11)" if key[0] == "crasher" else row["value"] > 0


def test_a_run_of_some_sizes_never_drops_the_others_from_the_results_file():
    """`dkm_onnx.py --sizes issue` or `dkm_inference.py --sizes tiny` (with or without --only-missing) keeps the
    stored sizes it does not run when the file is of this machine and these settings, and stops in one line before
    measuring when it is not (an older file without its CPU lost the smollm2 rows this way, exit 0);
    `slices.kept_sizes` is the rule both scripts call."""
    import dkm_inference
    import dkm_onnx
    import pytest
    from harness import slices

    assert "slices.kept_sizes(" in inspect.getsource(dkm_onnx.main)
    assert "slices.kept_sizes(" in inspect.getsource(dkm_inference.run_peers)
    config = {"rounds": 2, "new_tokens": 16, "slow_tokens": 2, "prefill": 128}
    sizes = {"issue": {"summary": 1}, "smollm2": {"summary": 2}}
    here = {"cpu": dkm_onnx.cpu_model(), "device": "cpu"}
    mine = {**here, "config": {**config, "rounds": 1}, "sizes": sizes}
    assert slices.kept_sizes("x", mine, here, config, ["issue"], only_missing=False) == {"smollm2": {"summary": 2}}
    assert slices.kept_sizes("x", mine, here, config, ["issue"], only_missing=True) == sizes
    for other in ({"config": config, "sizes": sizes}, {**mine, "device": "cuda"}):  # no CPU recorded; a GPU's file
        for only_missing, run in ((True, ["issue"]), (True, ["issue", "smollm2"]), (False, ["issue"])):
            with pytest.raises(SystemExit, match=r"^error: .* \(--sizes issue smollm2\) to replace it") as stop:
                slices.kept_sizes("x", other, here, config, run, only_missing=only_missing)
            assert "\n" not in str(stop.value)
        assert slices.kept_sizes("x", other, here, config, ["issue", "smollm2"], only_missing=False) == {}
    # without the loose keys (dkm_inference.py: every setting counts) fewer rounds are other settings
    with pytest.raises(SystemExit, match=r"^error: "):
        slices.kept_sizes("x", mine, here, config, ["issue"], only_missing=False, loose=())
    assert slices.kept_sizes("x", {}, here, config, ["issue"], only_missing=True) == {}
