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


def test_lora_on_an_upcycled_model_adapts_the_attention_projections_by_default(run_clm, tmp_path):
    """Issue 52: `--peft_method lora --upcycle_moe true` died in peft's "No `target_modules` passed" (peft empties the
    unset list while converting Mixtral's config, then finds no default); now peft's own default for the family."""
    results = run_clm.run([*TINY, *MOE, "--peft_method", "lora", "--output_dir", str(tmp_path), "--max_steps", "1"])
    assert results["global_step"] == 1
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]


def test_lora_without_targets_on_a_family_peft_has_no_default_for_names_the_flag():
    from peft import LoraConfig
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from hf_llmkit.cli.features.peft import default_lora_targets

    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
    ))  # fmt: skip
    with pytest.raises(ValueError, match=r"^--peft_method lora has no default --target_modules for a qwen2_moe model: "
                       r"pass --target_modules \(e.g. --target_modules q_proj,v_proj\)$"):  # fmt: skip
        default_lora_targets(LoraConfig(task_type="CAUSAL_LM"), model)
    given = LoraConfig(task_type="CAUSAL_LM", target_modules=["o_proj"])
    default_lora_targets(given, model)
    assert given.target_modules == {"o_proj"}  # the user's choice stays


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
