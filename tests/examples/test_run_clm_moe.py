"""examples/run_clm.py --upcycle_moe: the dense tiny Llama is trained as an upcycled Mixtral."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from tests.examples.test_run_clm import TINY

MOE = ["--upcycle_moe", "true", "--moe_num_experts", "4", "--moe_top_k", "2"]


def test_upcycled_training_saves_a_native_mixtral_and_logs_expert_load(run_clm, tmp_path):
    results = run_clm.run([*TINY, *MOE, "--output_dir", str(tmp_path), "--max_steps", "2", "--save_steps", "2"])
    assert results["global_step"] == 2
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.model_type == "mixtral" and config.num_local_experts == 4 and config.num_experts_per_tok == 2
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    logs = [entry for entry in state["log_history"] if "loss" in entry]
    assert all("moe_load_max_min_ratio" in entry and "moe_aux_loss" in entry for entry in logs)
    # re-running the same command resumes the upcycled model from its checkpoint
    again = run_clm.run([*TINY, *MOE, "--output_dir", str(tmp_path), "--max_steps", "3", "--save_steps", "2"])
    assert again["resumed_at"] == 2 and again["global_step"] == 3


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--moe_top_k", "5", "--moe_num_experts", "4"], "--moe_top_k 5 must be between 1 and --moe_num_experts 4"),
        (["--moe_capacity_factor", "0"], "--moe_capacity_factor 0.0 must be > 0"),
    ],
    ids=["top-k", "capacity"],
)
def test_bad_moe_options_name_the_flag(run_clm, tmp_path, args, expected):
    with pytest.raises(run_clm.UsageError, match=expected.replace("(", r"\(")):
        run_clm.run([*TINY, "--upcycle_moe", "true", *args, "--output_dir", str(tmp_path)])


def test_upcycle_with_dkm_clusters_the_upcycled_model(run_clm, tmp_path):
    """--upcycle_moe with --quantization dkm: experts are copied from the full-precision MLPs, then DKM clusters the
    Mixtral's Linear layers (the fused experts stay full precision); the saved model reloads packed."""
    from hf_llmkit.quantization import PalettizedLinear

    args = [*TINY, *MOE, "--quantization", "dkm", "--dkm_bits", "2", "--output_dir", str(tmp_path)]
    results = run_clm.run([*args, "--max_steps", "1", "--save_steps", "100"])
    assert results["global_step"] == 1
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(model).__name__ == "MixtralForCausalLM"
    assert isinstance(model.model.layers[0].self_attn.q_proj, PalettizedLinear)
