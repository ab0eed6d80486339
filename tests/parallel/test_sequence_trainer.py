"""`LLMKitTrainer` with `sequence_parallel_size=2` on 2 CPU ranks equals single-rank training (also with the ALST
switches: tiled loss, tiled MLP, activation-checkpoint offload).

`sp_train_script.py` trains 3 SGD steps on padded SFT-style rows and replays the same global batches in a plain
single-process loop; parameters, logged losses and the eval loss must agree (fp32).

Starting the ranks costs more than what they train, so each launcher starts them once for every test of this file
that the session runs: `accelerate launch` for DDP and then examples/run_clm.py, `torchrun` for both ZeRO stages.
"""

from __future__ import annotations

import importlib.util
import json
from functools import partial
from pathlib import Path

import pytest

from hf_llmkit.testing import launch_script
from tests.warm import torchrun

SCRIPT = Path(__file__).with_name("sp_train_script.py")
# sp_train_script.py configurations: name -> (launcher, flags)
CASES = {
    "ddp_lora": ("accelerate", ["--peft", "lora", "--gradient_checkpointing", "--kv_heads", "1"]),
    "zero2": ("torchrun", ["--zero", "2", "--peft", "bottleneck"]),
    "zero3": ("torchrun", ["--zero", "3", "--gradient_checkpointing", "--long_sequence"]),
}
TINY = ["--vocab_size", "512", "--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "2",
        "--max_position_embeddings", "64", "--block_size", "32", "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "8", "--max_train_samples", "32", "--max_eval_samples", "16",
        "--logging_steps", "1", "--disable_tqdm", "true", "--warmup_steps", "0"]  # fmt: skip
ALST = ["--gradient_checkpointing", "true", "--tiled_loss", "true", "--tiled_loss_chunk_size", "5",
        "--tiled_mlp", "true", "--offload_activation_checkpoints", "true"]  # fmt: skip


def _needs(item) -> str | None:
    """The case (or "run_clm") a test of this file takes from a launch."""
    if item.originalname == "test_deepspeed_zero_torchrun":
        return f"zero{item.callspec.params['stage']}"
    return {
        "test_accelerate_ddp_lora_gradient_checkpointing_replicated_kv": "ddp_lora",
        "test_run_clm_sequence_parallel_size_and_alst_flags": "run_clm",
    }.get(item.originalname)


class Launches:
    """Starts each launcher's ranks once, the first time a test asks for one of its cases."""

    def __init__(self, workdir: Path, needs: set[str]):
        self.workdir, self.needs = workdir, needs
        self.done: dict[str, tuple[dict, str]] = {}  # launcher -> (results per case, the launch's output)

    def run(self, launcher: str) -> tuple[dict, str]:
        if launcher not in self.done:
            folder = self.workdir / launcher
            folder.mkdir()
            cases = {name: flags for name, (via, flags) in CASES.items() if via == launcher and name in self.needs}
            flags = ["--out", str(folder / "result.json"), "--cases", json.dumps(cases)]
            if launcher == "accelerate" and "run_clm" in self.needs:
                run_clm = [*TINY, *ALST, "--output_dir", str(folder / "run_clm"), "--max_steps", "2"]
                flags += ["--run_clm", json.dumps([*run_clm, "--sequence_parallel_size", "2"])]
            timeout = 300 + 200 * len(cases)
            run = partial(launch_script, launcher=launcher) if launcher != "torchrun" else torchrun  # accelerate's own
            out = run(SCRIPT, flags, nprocs=2, timeout=timeout, cwd=folder)
            self.done[launcher] = json.loads((folder / "result.json").read_text()), out.stdout
        return self.done[launcher]

    def result(self, case: str) -> dict:
        return self.run(CASES[case][0])[0][case]


@pytest.fixture(scope="module")
def launches(tmp_path_factory, request) -> Launches:
    needs = {_needs(item) for item in request.session.items if item.module is request.module} - {None}
    if importlib.util.find_spec("deepspeed") is None:  # their tests skip; the others still run
        needs -= {"zero2", "zero3"}
    return Launches(tmp_path_factory.mktemp("sequence_trainer"), needs)


def check(result: dict, engine: str) -> None:
    assert result["world"] == 2 and result["engine"] == engine
    assert result["attn"].startswith("llmkit_ulysses_sdpa")
    assert result["param_diff"] < 1e-5
    assert result["losses"] == pytest.approx(result["ref_losses"], abs=1e-5)
    assert result["eval_loss"] == pytest.approx(result["ref_eval_loss"], abs=1e-5)


def test_accelerate_ddp_lora_gradient_checkpointing_replicated_kv(launches):
    check(launches.result("ddp_lora"), "DistributedDataParallel")


# ZeRO-2 also trains in tests/compat/test_deepspeed.py and the composition matrix (slow here).
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_deepspeed_zero_torchrun(launches, stage):
    """ZeRO-2 with our bottleneck adapters; ZeRO-3 (partitioned parameters, gathered at each chunk's call) with
    gradient checkpointing and the ALST switches."""
    pytest.importorskip("deepspeed")
    check(launches.result(f"zero{stage}"), "DeepSpeedEngine")


def test_run_clm_sequence_parallel_size_and_alst_flags(launches):
    """examples/run_clm.py gets --sequence_parallel_size and the ALST switches from LLMKitTrainingArguments and
    trains on 2 ranks (under `accelerate launch`, after the DDP case in the same ranks)."""
    stdout = launches.run("accelerate")[1]
    out = launches.workdir / "accelerate" / "run_clm"
    assert "| 2 " in stdout.split("| ranks")[1].splitlines()[0]
    state = json.loads((out / "trainer_state.json").read_text())
    # 32 blocks, 4 per step, one data-parallel group: 8 steps per epoch (the SP ranks share each batch)
    assert state["global_step"] == 2 and state["log_history"][0]["epoch"] == pytest.approx(1 / 8)
    assert all(0 < log["loss"] < 10 for log in state["log_history"] if "loss" in log)
    assert (out / "model.safetensors").is_file()
