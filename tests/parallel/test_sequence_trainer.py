"""`LLMKitTrainer` with `sequence_parallel_size=2` on 2 CPU ranks equals single-rank training (also with the ALST
switches: tiled loss, tiled MLP, activation-checkpoint offload).

`sp_train_script.py` trains 3 SGD steps on padded SFT-style rows and replays the same global batches in a plain
single-process loop; parameters, logged losses and the eval loss must agree (fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_llmkit.testing import launch_script

SCRIPT = Path(__file__).with_name("sp_train_script.py")


def run(tmp_path: Path, launcher: str, *flags: str) -> dict:
    out = tmp_path / "result.json"
    launch_script(SCRIPT, ["--out", str(out), *flags], nprocs=2, launcher=launcher, timeout=400, cwd=tmp_path)
    return json.loads(out.read_text())


def check(result: dict, engine: str) -> None:
    assert result["world"] == 2 and result["engine"] == engine
    assert result["attn"].startswith("llmkit_ulysses_sdpa")
    assert result["param_diff"] < 1e-5
    assert result["losses"] == pytest.approx(result["ref_losses"], abs=1e-5)
    assert result["eval_loss"] == pytest.approx(result["ref_eval_loss"], abs=1e-5)


def test_accelerate_ddp_lora_gradient_checkpointing_replicated_kv(tmp_path):
    result = run(tmp_path, "accelerate", "--peft", "lora", "--gradient_checkpointing", "--kv_heads", "1")
    check(result, "DistributedDataParallel")


# ZeRO-2 (~20 s) also trains in tests/compat/test_deepspeed.py and the composition matrix (slow here).
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_deepspeed_zero_torchrun(tmp_path, stage):
    """ZeRO-2 with our bottleneck adapters; ZeRO-3 (partitioned parameters, gathered at each chunk's call) with
    gradient checkpointing and the ALST switches."""
    pytest.importorskip("deepspeed")
    flags = ["--zero", str(stage)]
    flags += ["--gradient_checkpointing", "--long_sequence"] if stage == 3 else ["--peft", "bottleneck"]
    check(run(tmp_path, "torchrun", *flags), "DeepSpeedEngine")


def test_run_clm_sequence_parallel_size_and_alst_flags(tmp_path):
    """examples/run_clm.py gets --sequence_parallel_size and the ALST switches from LLMKitTrainingArguments and
    trains on 2 ranks."""
    example = Path(__file__).resolve().parents[2] / "examples" / "run_clm.py"
    tiny = ["--vocab_size", "512", "--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "2",
            "--max_position_embeddings", "64", "--block_size", "32", "--per_device_train_batch_size", "4",
            "--per_device_eval_batch_size", "8", "--max_train_samples", "32", "--max_eval_samples", "16",
            "--logging_steps", "1", "--disable_tqdm", "true", "--warmup_steps", "0"]  # fmt: skip
    alst = ["--gradient_checkpointing", "true", "--tiled_loss", "true", "--tiled_loss_chunk_size", "5",
            "--tiled_mlp", "true", "--offload_activation_checkpoints", "true"]  # fmt: skip
    out = launch_script(
        example,
        [*tiny, *alst, "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--sequence_parallel_size", "2"],
        nprocs=2,
        launcher="accelerate",
        timeout=300,
    )
    assert "| 2 " in out.stdout.split("| ranks")[1].splitlines()[0]
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    # 32 blocks, 4 per step, one data-parallel group: 8 steps per epoch (the SP ranks share each batch)
    assert state["global_step"] == 2 and state["log_history"][0]["epoch"] == pytest.approx(1 / 8)
    assert all(0 < log["loss"] < 10 for log in state["log_history"] if "loss" in log)
    assert (tmp_path / "out" / "model.safetensors").is_file()
