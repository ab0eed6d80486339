"""`dkm_quality.py --only smollm2` finishes in slices (issue 51): a run killed at any moment keeps every row it saved
(the results file is written whole, atomically), its calibrated start is cached on disk, and the same command run
again measures only the rows still missing, the trained ones from the cached start; a run whose settings differ from
the rows the file holds is refused in one line. On the quick mode's 2-layer slice of the real SmolLM2, our rows only
(`--rows`), the kill injected where the trained row starts (`$HF_LLMKIT_BENCH_CRASH`: SIGSEGV, as kill -9 would)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.benchmarks.conftest import bench_env, run_script

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from areas.dkm import real  # noqa: E402

NAMES = real._names(2)
ARGS = ["--quick", "--only", "smollm2", "--rows", "dkm 2-bit"]  # ours: the start, trained from it, eDKM


def _rows(results: Path) -> dict[str, dict]:
    return {r["method"]: r for r in json.loads((results / "dkm_quality.json").read_text())["real_model"]["rows"]}


def test_a_killed_run_keeps_its_rows_and_the_rerun_measures_only_the_missing_ones(tmp_path, tmp_path_factory):
    env = bench_env(tmp_path_factory, tmp_path)
    shutil.rmtree(Path(env["HF_LLMKIT_CACHE"]) / "dkm_quality", ignore_errors=True)  # the start computed here
    killed = run_script("dkm_quality.py", ARGS, {**env, "HF_LLMKIT_BENCH_CRASH": NAMES["trained"]}, 300)
    assert killed[0] == -11, killed[1]  # died as it started the trained row
    first = _rows(tmp_path)
    assert list(first) == [NAMES["start"]] and "error" not in first[NAMES["start"]]  # nothing else chosen or saved
    assert "calibrated start 2-bit: computing" in killed[1]
    (cached,) = (Path(env["HF_LLMKIT_CACHE"]) / "dkm_quality").glob("start-2bit-*.pt")

    code, output = run_script("dkm_quality.py", ARGS, env, 300)
    assert code == 0, output
    assert f"recorded already (kept): {NAMES['start']}" in output
    assert f"calibrated start 2-bit: from its cache {cached.name}" in output and "computing" not in output
    rows = _rows(tmp_path)
    assert rows[NAMES["start"]] == first[NAMES["start"]]  # kept as it was, not measured again
    assert list(rows) == [NAMES["start"], NAMES["trained"], NAMES["soft"]]
    for name in (NAMES["trained"], NAMES["soft"]):  # eDKM's weighted iterations: the start carries its importance
        assert "error" not in rows[name] and rows[name]["bpw"] == rows[NAMES["start"]]["bpw"], rows[name]


def test_a_run_with_other_settings_than_the_rows_held_is_refused_in_one_line():
    held = {"rows": [{"method": "x"}], "steps": 24, "lr": 2e-5, "split": {"eval_tokens": 16384}, "block": 512,
            "calibration": [128, 256], "train_batch": [4, 128]}  # fmt: skip
    args = SimpleNamespace(new_table=False)
    real.check_settings(held, dict(held, rows=[]), args)  # the same settings: rows are added
    with pytest.raises(SystemExit) as refused:
        real.check_settings(held, dict(held, steps=40), args)
    assert str(refused.value) == (
        "error: benchmarks/results/dkm_quality.json's smollm2 rows were measured with steps 24 (this run: 40): pass "
        "--steps 24 to add rows to that table, or pass --new-table to measure a new one in its place"
    )
    real.check_settings(held, dict(held, steps=40), SimpleNamespace(new_table=True))  # a new table in their place
