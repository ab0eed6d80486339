"""The soft-assignment study's and the step-cost section's docs lines (`benchmarks/areas/dkm/soft_report.py`): the
verdict names the best soft variant and says which training wins on every metric, and each step row is held to the
issue's bound and the kernel's saved bytes to the torch ops'."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from areas.dkm import soft_report as report  # noqa: E402


def _row(variant, bits, kl, top1):
    return {"variant": variant, "bits": bits, "kl": kl, "top1": top1}


def test_the_verdict_compares_the_best_soft_variant_with_straight_through_on_every_metric():
    rows = [
        _row("calibrated start, no training", 3, 0.30, 0.80),
        _row(report.STRAIGHT, 3, 0.20, 0.85),
        _row("soft, a", 3, 0.25, 0.84),
        _row("soft, b", 3, 0.22, 0.86),  # the best soft variant by the first metric
        _row(report.STRAIGHT, 2, 0.50, 0.70),
        _row("soft, a", 2, 0.40, 0.75),
    ]
    study = {"workloads": {"model": {"metrics": ["kl", "top1"], "rows": rows}}}
    lines = report.study_verdicts(study)
    assert lines[0].startswith("model, 2-bit: soft wins: the best soft variant (soft, a)")
    assert lines[1].startswith("model, 3-bit: mixed (soft better on top1): the best soft variant (soft, b)")
    assert "kl 0.22 vs 0.2" in lines[1]


def test_every_target_row_is_held_to_its_bound_and_the_kernel_to_the_torch_ops_saved_bytes():
    summary = {
        "DKM 3-bit fp32": {"ratio_min": 1.5, "ratio_median": 1.6},
        "DKM 3-bit bf16": {"ratio_min": 1.2, "ratio_median": 1.4},
    }
    saved = {"DKM 3-bit fp32": 10.0, "DKM 3-bit fp32, torch ops (no kernel)": 12.0}
    lines = report.step_targets({"workloads": {"m": {"summary": summary, "saved_mib": saved}}})
    assert lines[0] == "[issue] m, DKM 3-bit fp32: 1.50 / 1.60 x the plain fp32 step (min / median; holds <= 2.0)"
    assert lines[1] == "[issue] m, DKM 3-bit bf16: 1.20 / 1.40 x the plain fp32 step (min / median; FAILS <= 1.3)"
    assert lines[2].endswith("the torch ops 12.0 (holds: no more than before)")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the quick run another worker makes is waited for
def test_the_sections_quick_modes_write_what_their_fragments_render(quick_run):
    """The steps and soft sections of `dkm_quality.py --quick` (its one run of the test run, which
    test_quick_modes.py reads too): one MiniLM matrix and a 2-layer SmolLM2, one round, one step."""
    import json

    import report as docs

    run = quick_run("dkm_quality.py")
    run.check()
    data = json.loads((run.folder / "dkm_soft.json").read_text())
    assert set(data["steps"]["workloads"]) == {"all-MiniLM-L6-v2", "SmolLM2-135M-Instruct"}
    rows = data["study"]["workloads"]["all-MiniLM-L6-v2"]["rows"]
    assert [r["variant"] for r in rows][1:] == [report.STRAIGHT, "soft, tables and scales kept"]
    for name in ("dkm_steps", "dkm_soft"):
        assert "_Measured " in docs.render(name, results=run.folder), name
