"""LossScaleCallback with a real torch.amp.GradScaler("cpu") and injected inf gradients."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from hf_llmkit.callbacks import LossScaleCallback
from tests.callbacks.deepspeed_support import deepspeed_fp16_loss_scale
from tests.callbacks.support import make_trainer, small_model
from tests.warm import launch

REPO = Path(__file__).resolve().parents[2]

KEYS = ("loss_scale", "loss_scale_overflows", "loss_scale_overflows_total", "skipped_steps", "skipped_steps_total")


class _Recorder(TrainerCallback):
    """Stands where the reporting integrations (TensorBoard, W&B) sit in the callback list."""

    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append(dict(logs))


def _inject_inf(model, at_backward: set[int]):
    """Turn the gradient of one weight into inf on the given (1-based) backward passes: an fp16 overflow."""
    weight = model.model.embed_tokens.weight
    calls = {"n": 0}

    def hook(grad):
        calls["n"] += 1
        return torch.full_like(grad, float("inf")) if calls["n"] in at_backward else grad

    weight.register_hook(hook)


def _run(tmp_path, *, plain=False, scaler=None, inject=(), **callback_kwargs):
    model = small_model()
    _inject_inf(model, set(inject))
    callback = LossScaleCallback(**callback_kwargs)
    trainer = make_trainer(
        tmp_path, model=model, callbacks=[callback], plain=plain, max_steps=6, logging_steps=2, save_strategy="no"
    )
    reporter = _Recorder()
    trainer.callback_handler.callbacks.insert(1, reporter)  # right after DefaultFlowCallback, like report_to
    if scaler is not None:
        trainer.accelerator.scaler = scaler  # a real GradScaler: accelerate's backward/step use it
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer, history, reporter.logs


def test_overflows_and_skipped_steps_are_counted_per_window_and_in_total(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    trainer, history, reported = _run(tmp_path, scaler=scaler, inject=(2, 3))
    assert [entry["loss_scale"] for entry in history] == [512.0, 256.0, 256.0]
    assert [entry["loss_scale_overflows"] for entry in history] == [1, 1, 0]
    assert [entry["loss_scale_overflows_total"] for entry in history] == [1, 2, 2]
    assert [entry["skipped_steps"] for entry in history] == [1, 1, 0]
    assert [entry["skipped_steps_total"] for entry in history] == [1, 2, 2]
    assert scaler.get_scale() == 256.0
    # LLMKitTrainer routes them through Trainer.log: callbacks in the reporters' position receive them too.
    assert [entry["loss_scale"] for entry in reported] == [512.0, 256.0, 256.0]


def test_plain_trainer_gets_them_in_log_history(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=1000)
    _, history, reported = _run(tmp_path, plain=True, scaler=scaler, inject=(5,))
    assert [entry["loss_scale_overflows"] for entry in history] == [0, 0, 1]
    assert [entry["loss_scale"] for entry in history] == [64.0, 64.0, 32.0]
    assert all("loss_scale" not in entry for entry in reported)  # reporters run before user callbacks


def test_nothing_is_logged_without_a_loss_scaler(tmp_path):
    _, history, reported = _run(tmp_path)
    assert history and all(key not in entry for entry in history + reported for key in KEYS)


def test_scale_collapse_warns_once(tmp_path, caplog):
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1000)
    with caplog.at_level(logging.WARNING, logger="hf_llmkit.callbacks.loss_scale"):
        _, history, _ = _run(tmp_path, scaler=scaler, inject=(1, 2, 3, 4), min_scale=1.0)
    assert history[-1]["loss_scale"] == 0.25
    assert len([r for r in caplog.records if "collapsed" in r.getMessage()]) == 1


def test_bad_min_scale_names_the_fix():
    with pytest.raises(ValueError, match="min_scale"):
        LossScaleCallback(min_scale=0)


def test_deepspeed_fp16_live_scale_and_skipped_steps(tmp_path):
    """DeepSpeed ZeRO-2 fp16 on one CPU rank, initial scale 2**8, inf gradients on steps 2 and 3."""
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():  # DeepSpeed's CPU accelerator asks oneDNN for fp16 kernels
        pytest.skip(f"DeepSpeed's {get_accelerator().device_name()} accelerator reports no fp16 support here")
    result = launch(deepspeed_fp16_loss_scale, str(tmp_path), 2, nprocs=1, timeout=300, env={"PYTHONPATH": str(REPO)})[
        0
    ]
    logs = result["logs"]
    # The live scale (hysteresis 2: the second overflow halves it), not the configured 256.
    assert [entry["loss_scale"] for entry in logs] == [256.0, 128.0, 128.0]
    assert [entry["loss_scale_overflows"] for entry in logs] == [1, 1, 0]
    assert logs[-1]["skipped_steps_total"] == result["engine_skipped"] == 2
