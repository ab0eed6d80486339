"""Mixed precision on CUDA: fp16 autocast with the GradScaler accelerate creates (`LossScaleCallback`'s real case:
the live scale logged, overflows and skipped steps counted) and bf16 autocast (no scaler, nothing logged).

The CPU counterparts install a real `torch.amp.GradScaler("cpu")` by hand: tests/callbacks/test_loss_scale.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_llmkit.callbacks import LossScaleCallback
from tests.callbacks.support import make_trainer, small_model
from tests.callbacks.test_loss_scale import KEYS, _inject_inf

pytestmark = pytest.mark.gpu


def train(tmp_path, *, device: str, precision: str, inject: tuple[int, ...] = ()):
    """6 steps, a log every 2, with `precision` ("fp16" / "bf16") autocast; inf gradients on the `inject` backwards.
    Returns the trainer, its training logs, the scale before training and the dtypes one MLP produced."""
    model = small_model()
    _inject_inf(model, set(inject))
    dtypes: list[torch.dtype] = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    trainer = make_trainer(
        tmp_path,
        model=model,
        callbacks=[LossScaleCallback()],
        use_cpu=device == "cpu",
        max_steps=6,
        logging_steps=2,
        save_strategy="no",
        **{precision: True},
    )
    scaler = trainer.accelerator.scaler
    initial = float(scaler.get_scale()) if scaler is not None else None
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer, history, initial, set(dtypes)


def test_fp16_autocast_with_accelerates_grad_scaler_logs_the_live_scale_and_skipped_steps(tmp_path):
    trainer, history, initial, dtypes = train(tmp_path, device="cuda", precision="fp16", inject=(2, 3))
    scaler = trainer.accelerator.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()  # the one accelerate made, not ours
    assert next(trainer.model.parameters()).device.type == "cuda"
    assert dtypes == {torch.float16}
    # each overflow halves the scale (growth needs 2,000 clean steps): windows of 2 steps, overflows on steps 2, 3
    assert [entry["loss_scale"] for entry in history] == [initial / 2, initial / 4, initial / 4]
    assert [entry["loss_scale_overflows"] for entry in history] == [1, 1, 0]
    assert [entry["skipped_steps"] for entry in history] == [1, 1, 0]
    assert history[-1]["skipped_steps_total"] == history[-1]["loss_scale_overflows_total"] == 2
    assert float(scaler.get_scale()) == initial / 4
    assert all(math.isfinite(entry["loss"]) for entry in history)


def test_bf16_autocast_trains_without_a_scaler_and_logs_no_scale(tmp_path):
    before = small_model().model.embed_tokens.weight.detach().clone()
    trainer, history, initial, dtypes = train(tmp_path, device="cuda", precision="bf16")
    assert trainer.accelerator.scaler is None and initial is None
    assert next(trainer.model.parameters()).device.type == "cuda"
    assert dtypes == {torch.bfloat16}
    assert all(key not in entry for entry in history for key in KEYS)
    assert all(math.isfinite(entry["loss"]) for entry in history)
    assert not torch.equal(trainer.model.model.embed_tokens.weight.detach().cpu(), before)  # every step applied
