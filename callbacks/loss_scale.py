"""`LossScaleCallback`: log the live fp16 loss scale, overflows and skipped steps, through the Trainer's log.

fp16 training scales the loss so small gradients survive; on an overflow the step is skipped and the scale
halved. The HF Trainer logs none of it (only `grad_norm`), whatever runs the scaling. DeepSpeed reports it its own
way: with a monitor in its config (TensorBoard, W&B, CSV) it writes `Train/Samples/loss_scale` at every
optimizer step, it prints "OVERFLOW! Skipping step" on each overflow and `skipped=<count>` in its progress line
every `steps_per_print` steps -- into its own monitor and console, not the Trainer's log, so `report_to`
integrations and `log_history` never see them. This callback adds to every training log:

- `loss_scale`: the scale in use now (torch AMP `GradScaler` through accelerate, or DeepSpeed's live `cur_scale`,
  not the configured initial value);
- `loss_scale_overflows` / `loss_scale_overflows_total`: overflows in this logging window / since the start;
- `skipped_steps` / `skipped_steps_total`: optimizer steps skipped in this window / since the start.

It logs nothing when no loss scaler is active (bf16, fp32), so no misleading constant `1.0` appears, and it warns
once when the scale falls to its minimum (`min_scale`, or DeepSpeed's `min_loss_scale`): from then on overflows
are no longer absorbed. With `LLMKitTrainer` the values go through `Trainer.log`, so TensorBoard and the other
reporters receive them; with a plain `Trainer` they reach `log_history` and the progress output only
(see `hf_llmkit.log_bridge`).

Example:
    ```python
    from hf_llmkit import LLMKitTrainingArguments
    from hf_llmkit.callbacks import LossScaleCallback
    from hf_llmkit.trainers import LLMKitTrainer

    args = LLMKitTrainingArguments(output_dir="outputs/fp16", fp16=True, logging_steps=10)
    trainer = LLMKitTrainer(model=model, args=args, train_dataset=data, callbacks=[LossScaleCallback()])
    trainer.train()  # logs: {'loss': ..., 'loss_scale': 32768.0, 'loss_scale_overflows': 0, ...}
    ```
"""

from __future__ import annotations

import logging
import numbers

from transformers import TrainerCallback

from hf_llmkit.log_bridge import add_callback_logs

logger = logging.getLogger(__name__)


def _optimizer_chain(optimizer):
    """The optimizer and the optimizers it wraps (accelerate wrapper -> DeepSpeed optimizer -> torch optimizer)."""
    seen = 0
    while optimizer is not None and seen < 5:
        yield optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1


def _number(value) -> float | None:
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None


class _AmpScale:
    """torch AMP `GradScaler` held by accelerate's `AcceleratedOptimizer.scaler`.

    An overflow is read off the scale itself (it drops exactly when inf/NaN gradients were found), not off
    accelerate's `step_was_skipped`: optimizers that handle AMP scaling themselves (fused AdamW, the Trainer's
    default) are always "called", so that flag stays False even when the update was skipped. The scale is read
    with the public `get_scale()` (a host read of one scalar per step).
    """

    name = "torch.amp.GradScaler"

    def __init__(self, scaler, min_scale: float):
        self.scaler, self.min_scale = scaler, min_scale
        self._before = None

    def _current(self) -> float:
        return float(self.scaler.get_scale())

    def before_step(self) -> None:
        self._before = self._current()

    def after_step(self, optimizer):
        """(overflow, skipped) for the step just taken."""
        if self._before is None:
            return False, False
        dropped = self._current() < self._before
        return dropped, dropped  # an overflow skips the update, whatever the optimizer reports

    def scale(self) -> float:
        return float(self.scaler.get_scale())  # a device sync: called once per logging window only


class _DeepSpeedScale:
    """DeepSpeed fp16: the live scale on its optimizer (`cur_scale` / `loss_scale`), not the configured one."""

    name = "deepspeed"

    def __init__(self, holder, min_scale: float):
        self.holder = holder
        config = getattr(holder, "loss_scale_config", None)
        scaler = getattr(holder, "loss_scaler", None)
        found = _number(getattr(config, "min_loss_scale", None)) or _number(getattr(scaler, "min_scale", None))
        self.min_scale = found if found is not None else min_scale

    def scale(self) -> float:
        value = _number(getattr(self.holder, "cur_scale", None))
        return value if value is not None else float(self.holder.loss_scale)

    def before_step(self) -> None:
        pass

    def after_step(self, optimizer):
        overflow = bool(getattr(self.holder, "overflow", False))
        return overflow, bool(getattr(optimizer, "step_was_skipped", overflow))


def _find_backend(optimizer, fp16: bool, min_scale: float):
    for candidate in _optimizer_chain(optimizer):
        scaler = getattr(candidate, "scaler", None)
        if scaler is not None and getattr(scaler, "is_enabled", lambda: True)():
            return _AmpScale(scaler, min_scale)
    if not fp16:  # DeepSpeed keeps a static scale of 1 under bf16/fp32: reporting it would mislead
        return None
    for candidate in _optimizer_chain(optimizer):
        cls = type(candidate).__module__
        if cls.startswith("deepspeed") and (
            _number(getattr(candidate, "cur_scale", None)) is not None
            or _number(getattr(candidate, "loss_scale", None)) is not None
        ):
            return _DeepSpeedScale(candidate, min_scale)
    return None


class LossScaleCallback(TrainerCallback):
    """Logs the live fp16 loss scale, overflows and skipped steps (see the module docstring).

    Args:
        min_scale: Scale at or below which the scale counts as collapsed (torch AMP has no minimum of its own;
            DeepSpeed's configured `min_loss_scale` takes precedence).
    """

    def __init__(self, *, min_scale: float = 1.0):
        if min_scale <= 0:
            raise ValueError(f"min_scale must be > 0 (e.g. 1.0), got {min_scale}")
        self.min_scale = min_scale
        self.backend = None
        self._optimizer = None
        self._window = {"overflows": 0, "skipped": 0}
        self._total = {"overflows": 0, "skipped": 0}
        self._warned_min = False
        self._announced = False

    def _attach(self, args, optimizer) -> None:
        if optimizer is self._optimizer:
            return
        self._optimizer = optimizer
        self.backend = _find_backend(optimizer, bool(getattr(args, "fp16", False)), self.min_scale)
        if not self._announced:
            self._announced = True
            if self.backend is None:
                logger.info("LossScaleCallback: no fp16 loss scaler in use (bf16/fp32): nothing to log")
            else:
                logger.info("LossScaleCallback: logging the live loss scale of %s", self.backend.name)

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self._attach(args, optimizer)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self._attach(args, optimizer)
        if self.backend is not None:
            self.backend.before_step()

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self.backend is None:
            return
        overflow, skipped = self.backend.after_step(optimizer)
        self._window["overflows"] += overflow
        self._window["skipped"] += skipped

    def _drain_window(self) -> tuple[int, int]:
        overflows, skipped = (int(self._window[key]) for key in ("overflows", "skipped"))
        self._window = {"overflows": 0, "skipped": 0}
        self._total["overflows"] += overflows
        self._total["skipped"] += skipped
        return overflows, skipped

    def contribute_logs(self, logs: dict, state) -> dict:
        """The window's values for a training log (`'loss'` in it); resets the window. Empty when inactive."""
        if self.backend is None or "loss" not in logs or "loss_scale" in logs:
            return {}
        scale = self.backend.scale()
        overflows, skipped = self._drain_window()
        added = {
            "loss_scale": scale,
            "loss_scale_overflows": overflows,
            "loss_scale_overflows_total": self._total["overflows"],
            "skipped_steps": skipped,
            "skipped_steps_total": self._total["skipped"],
        }
        if scale <= self.backend.min_scale and not self._warned_min:
            self._warned_min = True
            logger.warning(
                "the fp16 loss scale has collapsed to %g (minimum %g) after %d overflows: gradients are overflowing "
                "even unscaled; lower the learning rate, check the data, or train in bf16",
                scale,
                self.backend.min_scale,
                self._total["overflows"],
            )
        return added

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        added = add_callback_logs([self], logs, state)  # empty when LLMKitTrainer.log already merged them
        history = state.log_history
        if added and history and history[-1].get("step") == state.global_step and "loss" in history[-1]:
            history[-1].update(added)
