"""Counts above what exists are clamped with one warning line, and the results say what was done (issue 33):
`--max_train_samples` / `--max_eval_samples` above the split, `--dkm_calibration_samples` above the training
examples (the results table and train_results.json report the calibration samples used)."""

from __future__ import annotations

import logging

from hf_llmkit.cli.checks import at_most
from hf_llmkit.cli.results import results_table
from tests.conftest import load_example

SIZES = ["--vocab_size", "512", "--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "2"]
RESULTS = {"parameters": 10, "trainable_parameters": 10, "global_step": 2, "wall_time_s": 1.0, "output_dir": "o"}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_count_above_what_exists_is_clamped_with_one_warning_line(caplog):
    with caplog.at_level(logging.WARNING):
        assert at_most(None, 7, flag="--max_eval_samples", what="validation blocks") == 7
        assert at_most(5, 7, flag="--max_eval_samples", what="validation blocks") == 5
        assert not _warnings(caplog)
        assert at_most(100000, 7, flag="--max_eval_samples", what="validation blocks") == 7
    assert _warnings(caplog) == ["--max_eval_samples 100000 is more than the 7 validation blocks: using all 7"]


def test_calibration_samples_above_the_training_examples_are_clamped_and_reported(tmp_path, caplog):
    run_clm = load_example("run_clm")
    flags = [*SIZES, "--output_dir", str(tmp_path), "--quantization", "dkm", "--dkm_calibration_samples", "100000"]
    args = run_clm.parse_args(flags)
    with caplog.at_level(logging.WARNING):
        done = args.dkm.calibration(64, warn=True)
    assert done == {"dkm_calibration_samples": 64, "dkm_recipe": "dkm"}  # the count as clamped, the recipe named
    assert _warnings(caplog) == [
        "--dkm_calibration_samples 100000 is more than the 64 training examples: using all 64"
    ]
    assert "| DKM calibration        | 64 training examples" in results_table([], {**RESULTS, **done})
    assert run_clm.parse_args([*flags[:-2]]).dkm.calibration(64) == {}  # no calibration: nothing to report
    assert "calibration" not in results_table([], RESULTS)
