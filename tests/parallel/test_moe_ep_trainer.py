"""`LLMKitTrainer(expert_parallel_size=2)` on 2 CPU ranks equals `expert_parallel_size=1`, under DDP and ZeRO-2.

`ep_train_script.py` trains EP=1 and EP=2 from the same weights and batches (AdamW, clipping, gradient accumulation,
MoE auxiliary losses), resumes EP=2 from its step-2 checkpoint, and resumes EP=1 from that EP=2 checkpoint. The
checkpoints hold the full native Mixtral, which plain transformers loads here with the EP=1 model's logits.

One `torchrun` launch serves every test of this file that the session runs (the engines in turn, then
examples/run_clm.py with --expert_parallel_size 2): starting the ranks costs more than what they train.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, default_data_collator

from hf_llmkit import LLMKitTrainingArguments
from tests.parallel.ep_train_script import make_rows
from tests.warm import torchrun

SCRIPT = Path(__file__).with_name("ep_train_script.py")
TINY = ["--vocab_size", "512", "--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "2",
        "--max_position_embeddings", "64", "--block_size", "32", "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "8", "--max_train_samples", "32", "--max_eval_samples", "16",
        "--logging_steps", "1", "--disable_tqdm", "true", "--warmup_steps", "0"]  # fmt: skip
RUN_CLM = ["--upcycle_moe", "true", "--moe_num_experts", "4", "--expert_parallel_size", "2", "--max_steps", "2"]
# What each launched test needs from the launch: a ZeRO stage of ep_train_script.py, or the run_clm.py run.
NEEDS = {
    "test_ddp_expert_parallel_equals_data_parallel_and_resumes": 0,
    "test_deepspeed_zero2_expert_parallel_equals_data_parallel_and_resumes": 2,
    "test_run_clm_expert_parallel_size_flag": "run_clm",
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, request) -> tuple[Path, dict]:
    """One launch for what the session's tests of this module need: (its folder, rank 0's results per stage)."""
    needs = {NEEDS.get(item.originalname) for item in request.session.items if item.module is request.module}
    needs.discard(None)
    if importlib.util.find_spec("deepspeed") is None:  # its test skips; the others still run
        needs.discard(2)
    stages = sorted(n for n in needs if n != "run_clm")
    tmp = tmp_path_factory.mktemp("moe_ep_trainer")
    flags = ["--out", str(tmp / "result.json"), "--zero", *map(str, stages)]
    if "run_clm" in needs:
        flags += ["--run_clm", json.dumps([*TINY, "--output_dir", str(tmp / "run_clm"), *RUN_CLM])]
    torchrun(SCRIPT, flags, nprocs=2, timeout=300 + 200 * len(needs), cwd=tmp)
    return tmp, {int(stage): result for stage, result in json.loads((tmp / "result.json").read_text()).items()}


def check(result: dict, *, engine: str, local_experts: int) -> None:
    assert result["world"] == 2 and result["engine"] == engine and result["ep_size"] == 2
    assert result["local_experts"] == local_experts
    assert result["moved"] > 1e-3, "training did not change the weights"
    assert result["param_diff"] < 1e-5, f"EP=2 parameters differ from EP=1 by {result['param_diff']}"
    assert result["losses"] == pytest.approx(result["ref_losses"], abs=1e-5)
    assert result["grad_norms"] == pytest.approx(result["ref_grad_norms"], abs=1e-5)  # clipping saw all experts
    assert result["resume_diff"] == 0.0, "resuming EP=2 from its checkpoint changed the result"
    assert result["cross_resume_diff"] < 1e-5, "EP=1 cannot resume an EP=2 checkpoint"
    assert "has no MoE layer" in result["errors"]["dense"] and "--upcycle_moe" in result["errors"]["dense"]
    assert "not divisible by the expert-parallel group size 2" in result["errors"]["indivisible"]
    assert "cannot be combined with sequence_parallel_size" in result["errors"]["with_sp"]
    # A full native checkpoint: plain transformers' Mixtral, every expert, the EP=1 model's logits.
    model = AutoModelForCausalLM.from_pretrained(result["checkpoint"]).eval()
    block = model.model.layers[0].mlp
    assert type(block).__name__ == "MixtralSparseMoeBlock" and block.experts.gate_up_proj.shape[0] == 4
    batch = default_data_collator(make_rows(2))  # the script's fixed batch
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(logits, torch.load(result["logits"]), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("size", "message"), [(0, "must be >= 1"), (2, "divide the number of ranks (1)")])
def test_expert_parallel_size_is_validated(size, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLMKitTrainingArguments(output_dir="unused", expert_parallel_size=size)


def test_ddp_expert_parallel_equals_data_parallel_and_resumes(launched):
    check(launched[1][0], engine="DistributedDataParallel", local_experts=2)


@pytest.mark.slow
def test_deepspeed_zero2_expert_parallel_equals_data_parallel_and_resumes(launched):
    """ZeRO-2: every rank keeps all expert weights but computes only its own (see trainers/expert_parallel.py)."""
    pytest.importorskip("deepspeed")
    check(launched[1][2], engine="DeepSpeedEngine", local_experts=4)


@pytest.mark.slow
def test_run_clm_expert_parallel_size_flag(launched):
    """examples/run_clm.py --upcycle_moe true --expert_parallel_size 2 trains on 2 ranks and saves a full Mixtral."""
    model = AutoModelForCausalLM.from_pretrained(launched[0] / "run_clm")
    assert type(model).__name__ == "MixtralForCausalLM"
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
