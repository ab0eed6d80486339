"""examples/run_clm.py --quantization dkm: QAT in the main job, a packed checkpoint, bad options in one line."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_llmkit.quantization import PalettizedLinear
from tests.examples.test_run_clm import TINY


def test_run_clm_trains_with_dkm_and_saves_packed(run_clm, tmp_path):
    args = [*TINY, "--output_dir", str(tmp_path), "--max_steps", "2", "--torch_dtype", "bfloat16"]
    results = run_clm.run([*args, "--quantization", "dkm", "--dkm_bits", "4", "--save_steps", "100"])
    assert results["global_step"] == 2
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        packed = f.get_tensor("model.layers.0.mlp.up_proj.weight_packed")
    assert packed.dtype == torch.uint8 and packed.numel() == 128 * 64 * 4 // 8
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(model.model.layers[0].mlp.up_proj, PalettizedLinear)


def test_run_clm_rejects_bad_dkm_options(run_clm, tmp_path):
    with pytest.raises(run_clm.UsageError, match="bits must be an integer from 1 to 8"):
        run_clm.run([*TINY, "--output_dir", str(tmp_path), "--quantization", "dkm", "--dkm_bits", "9"])


def test_run_clm_calibrates_once_and_saves_what_one_call_gives(run_clm, tmp_path, monkeypatch, caplog):
    """--dkm_calibration_samples: the job ends with exactly one `calibrate` (no duplicate callback, no transformers
    warning), and the saved model is what one call gives: the same call replayed on a copy of the trained model
    saves the same tensors bit for bit."""
    import copy
    import logging

    from safetensors.torch import load_file

    from hf_llmkit.quantization import calibrate, training_state

    calls = []

    def counting(model, batches):
        batches = list(batches)
        calls.append((copy.deepcopy(model), batches))
        return calibrate(model, batches)

    monkeypatch.setattr(training_state, "calibrate", counting)
    args = [*TINY, "--output_dir", str(tmp_path / "job"), "--max_steps", "2", "--save_strategy", "no"]
    with caplog.at_level(logging.WARNING):
        run_clm.run([*args, "--quantization", "dkm", "--dkm_bits", "3", "--dkm_calibration_samples", "4"])
    assert "already one" not in caplog.text
    assert len(calls) == 1
    trained, batches = calls[0]
    calibrate(trained, batches)
    trained.save_pretrained(tmp_path / "replayed")
    saved, replayed = (load_file(tmp_path / d / "model.safetensors") for d in ("job", "replayed"))
    assert saved.keys() == replayed.keys() and any(k.endswith("weight_packed") for k in saved)
    assert all(torch.equal(saved[k], replayed[k]) for k in saved)
