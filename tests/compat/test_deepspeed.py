"""DeepSpeed on a CPU-only machine compiles nothing: the private hook still exists, and the shipped configs train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.warm import launch

deepspeed = pytest.importorskip("deepspeed")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_probe_cache_deepspeed_consults_before_building_still_exists():
    import importlib
    import inspect

    import deepspeed.ops

    from hf_llmkit.compat.deepspeed import CHECKED_AGAINST, CPU_COMM_OPS

    compatible = deepspeed.ops.__compatible_ops__
    assert isinstance(compatible, dict) and set(CPU_COMM_OPS) <= set(compatible), (
        f"deepspeed {deepspeed.__version__} changed __compatible_ops__ (checked against {CHECKED_AGAINST}); "
        "update hf_llmkit.compat.deepspeed"
    )
    comm_backend = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` is torch itself
    assert "__compatible_ops__" in inspect.getsource(comm_backend.build_shm_op)


def train_with_config(config_path: str, out_dir: str) -> dict:
    """Two LLMKitTrainer steps under a DeepSpeed config, one CPU rank; report the loss and the extension cache."""
    import os

    from hf_llmkit import LLMKitTrainingArguments
    from hf_llmkit.testing import tiny_llama
    from hf_llmkit.trainers import LLMKitTrainer

    rows = [{"input_ids": list(range(3, 19)), "labels": list(range(3, 19))} for _ in range(8)]
    args = LLMKitTrainingArguments(
        out_dir, deepspeed=config_path, max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
        report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    trainer = LLMKitTrainer(model=tiny_llama(), args=args, train_dataset=rows)
    trainer.train()
    built = os.listdir(os.environ["TORCH_EXTENSIONS_DIR"])
    return {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e], "built": built}


@pytest.mark.parametrize("config", ["ds_zero2_no_offload.json", "ds_zero3_offload.json"])
def test_shipped_deepspeed_configs_train_without_building_an_op(tmp_path, config):
    assert "optimizer" not in json.loads((EXAMPLES / config).read_text())  # the Trainer's torch AdamW is used
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    (report,) = launch(
        train_with_config, str(EXAMPLES / config), str(tmp_path / "out"), nprocs=1, timeout=240,
        init_process_group=False, env={"TORCH_EXTENSIONS_DIR": str(extensions), "ACCELERATE_USE_DEEPSPEED": "true"},
    )  # fmt: skip
    assert report["built"] == [], f"DeepSpeed JIT-compiled {report['built']} on a CPU-only machine"
    assert len(report["losses"]) == 2 and all(loss == loss for loss in report["losses"])
