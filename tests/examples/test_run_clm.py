"""The main job, examples/run_clm.py: trains on 1 and 2 ranks, resumes, rejects bad input in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from hf_llmkit.testing import launch_script, minilm_path
from tests.conftest import EXAMPLES

# A model and data small enough that a few steps take a second or two on 2 cores.
TINY = [
    "--vocab_size", "512", "--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "2",
    "--max_position_embeddings", "64", "--block_size", "32", "--per_device_train_batch_size", "4",
    "--per_device_eval_batch_size", "8", "--max_train_samples", "64", "--max_eval_samples", "16",
    "--logging_steps", "1", "--disable_tqdm", "true", "--warmup_steps", "0",
]  # fmt: skip


def test_trains_on_embedded_defaults(run_clm, tmp_path):
    results = run_clm.run([*TINY, "--output_dir", str(tmp_path), "--max_steps", "3"])
    assert results["global_step"] == 3
    assert results["eval_perplexity"] < results["eval_perplexity_before"]
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "eval_results.json").read_text())["eval_loss"] == pytest.approx(results["eval_loss"])


def test_resume_continues_from_checkpoint_step(run_clm, tmp_path):
    common = [*TINY, "--output_dir", str(tmp_path), "--save_steps", "2", "--save_total_limit", "3"]
    first = run_clm.run([*common, "--max_steps", "4"])
    assert first["global_step"] == 4 and (tmp_path / "checkpoint-4").is_dir()
    again = run_clm.run([*common, "--max_steps", "6"])  # the same command with a longer schedule
    assert again["resumed_at"] == 4
    assert again["global_step"] == 6
    state = json.loads((tmp_path / "checkpoint-6" / "trainer_state.json").read_text())
    logged_steps = [entry["step"] for entry in state["log_history"] if "loss" in entry]
    assert logged_steps == [1, 2, 3, 4, 5, 6]  # steps 5-6 follow 1-4 from the checkpoint's history


def test_overwrite_output_dir_starts_fresh(run_clm, tmp_path):
    common = [*TINY, "--output_dir", str(tmp_path), "--save_steps", "2", "--max_steps", "2"]
    run_clm.run(common)
    fresh = run_clm.run([*common, "--overwrite_output_dir", "true"])
    assert fresh["resumed_at"] == 0 and fresh["global_step"] == 2


def test_real_pretrained_model_folder(run_clm, tmp_path):
    """all-MiniLM-L6-v2 (real weights and WordPiece tokenizer) continues training as a causal LM."""
    model_dir = minilm_path()
    results = run_clm.run(
        ["--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path), "--max_steps", "2",
         "--block_size", "64", "--per_device_train_batch_size", "2", "--max_train_samples", "8",
         "--max_eval_samples", "4", "--learning_rate", "1e-4", "--disable_tqdm", "true"]
    )  # fmt: skip
    assert results["parameters"] > 20_000_000  # the real 22.7M-parameter model, not a from-scratch one
    assert results["global_step"] == 2
    saved = AutoTokenizer.from_pretrained(tmp_path)  # its own WordPiece tokenizer was used and saved
    assert len(saved) == len(AutoTokenizer.from_pretrained(model_dir)) == 30522


def test_two_ranks_with_accelerate_launch(tmp_path):
    out = launch_script(
        EXAMPLES / "run_clm.py",
        [*TINY, "--output_dir", str(tmp_path), "--max_steps", "3"],
        nprocs=2,
        launcher="accelerate",
        timeout=300,
    )
    assert "| ranks " in out.stdout and "| 2 " in out.stdout.split("| ranks")[1].splitlines()[0]
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert (tmp_path / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model_name_or_path", "no/such/model"], "--model_name_or_path no/such/model does not exist"),
        (["--train_file", "missing.txt"], "--train_file missing.txt does not exist"),
        (["--block_size", "100000"], "--block_size 100000 is larger than the model's context (512 positions)"),
    ],
    ids=["missing-model", "missing-data", "block-too-large"],
)
def test_bad_input_exits_with_one_line(tmp_path, args, expected):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "run_clm.py"), "--output_dir", str(tmp_path / "out"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing written for a rejected command
