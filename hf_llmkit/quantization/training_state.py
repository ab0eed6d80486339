"""Trainer checkpoints of a DKM model that resume bit for bit, and a compact model at the end.

A compact DKM checkpoint (packed indices + lookup tables) is all inference needs, but not all training needs: the
latent weights hold more than their hard assignment. While `keep_training_state` is on, `save_pretrained` also
writes each DKM layer's latent `weight` and `centroids`, and loading such a checkpoint (the Trainer's resume, or
`from_pretrained`) restores them exactly. `DKMTrainingStateCallback` turns it on for the length of `Trainer.train()`,
so every `checkpoint-N` is resumable bit for bit and `trainer.save_model()` afterwards is compact again.

The callback travels with the Trainer that trains a DKM model, never with the process: `LLMKitTrainer` (and so the
main jobs) adds it by itself when its model has trainable DKM layers (`add_training_state_callback`); a plain
`Trainer` or TRL's `SFTTrainer` takes it in `callbacks`:

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[DKMTrainingStateCallback()])
    trainer.train()                      # checkpoints: training state + packed export
    trainer.save_model("out")            # packed indices + lookup tables only

Forgetting it cannot go unnoticed: quantizing a model into trainable DKM layers installs a forward pre-hook
(`guard_training_state`) that, on the first training forward of a model whose training state nobody switched on or
off, raises when `DKMConfig(calibration_samples=N)` asks for a calibration nobody would run, and warns once
otherwise (checkpoints would restart from the hard assignment). A loop of your own says what it wants with
`keep_training_state(model, True)` (resumable checkpoints) or `keep_training_state(model, False)` (compact saves).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers import TrainerCallback

from hf_llmkit.checkpoints.transaction import WRITER, register_contributor
from hf_llmkit.quantization.calibration import calibrate, check_calibratable, first_examples
from hf_llmkit.quantization.layers import DKMEmbedding, DKMLinear

# A part of every checkpoint while the callback runs: the latent weights and tables, inside the model's weights file
# that the Trainer writes (hf_llmkit.checkpoints.transaction).
register_contributor("dkm training state", files=(), writer=__name__, via=WRITER)


def keep_training_state(model: nn.Module, enabled: bool = True) -> int:
    """Make `save_pretrained` of `model` also write its DKM layers' training state; returns the number of layers."""
    layers = _layers(model)
    for layer in layers:
        layer.keep_training_state = enabled
    return len(layers)


class DKMTrainingStateCallback(TrainerCallback):
    """Keeps DKM's training state in the Trainer's checkpoints from `on_train_begin` to `on_train_end`.

    A run resumed from one of those checkpoints ends bitwise equal to an uninterrupted run; without this callback
    the checkpoints are compact and a resume restarts the latent weights from their hard assignment (a warning says
    so). A model without DKM layers is left alone. `LLMKitTrainer` adds it when its model has trainable DKM layers;
    pass it to a plain `Trainer` / `SFTTrainer` in `callbacks` (see the module docstring).

    With `DKMConfig(calibration_samples=N)` it also ends each run with `calibrate` on the first `N` training
    examples (in dataset order, the same on every rank and in a resumed run), so the model the Trainer saves last is
    GPTQ's rounding onto the trained tables; checkpoints written during the run keep the latent weights as trained.
    With `recipe="calibrated"` that one calibration comes first instead, before the first step of a fresh run
    (refit tables, GPTQ-rounded latent weights: the start training continues from), and none at the end.
    """

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if model is None:
            return
        keep_training_state(model, True)
        _warn_unscaled(model, kwargs.get("optimizer"))
        if not _calibration_samples(model):
            return
        check_calibratable(model)  # fail before training, not after it
        if _recipe(model) == "calibrated" and state.global_step == 0 and train_dataloader is not None:
            _calibrate_on(model, train_dataloader, args)  # the start; a resumed run continues from its checkpoint

    def on_train_end(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if model is None:
            return
        keep_training_state(model, False)
        if _calibration_samples(model) and _recipe(model) == "dkm" and train_dataloader is not None:
            _calibrate_on(model, train_dataloader, args)


LATENT_GROUP = "dkm_latent_weights"  # the key that marks a parameter group of latent weights (value: the factor)


def scale_latent_lr(optimizer: torch.optim.Optimizer, model: nn.Module) -> int:
    """Give the trainable latent weights of `model`'s DKM layers their own parameter groups, at their config's
    `latent_lr_scale` times the rate of the group they were in (before the first step and before a scheduler is
    made from the optimizer: `LLMKitTrainer.create_optimizer` calls it); returns how many weights moved. Idempotent;
    nothing moves at a factor of 1."""
    scale = {id(m.weight): m.settings.config.latent_lr_scale for m in _layers(model) if m.weight.requires_grad}
    groups, moved = [], 0
    for group in optimizer.param_groups:
        if LATENT_GROUP in group:
            groups.append(group)
            continue
        by_factor: dict[float, list] = {}
        for p in group["params"]:
            by_factor.setdefault(scale.get(id(p), 1.0), []).append(p)
        for factor, params in sorted(by_factor.items(), reverse=True):
            if factor == 1.0:
                groups.append({**group, "params": params})
                continue
            moved += len(params)
            lr = group["lr"] * factor
            groups.append({**group, "params": params, "lr": lr, "lr_scale": factor, LATENT_GROUP: factor})
    if moved:
        optimizer.param_groups.clear()
        for group in groups:
            optimizer.add_param_group(group)
    return moved


def _warn_unscaled(model: nn.Module, optimizer) -> None:
    factors = {m.settings.config.latent_lr_scale for m in _layers(model) if m.weight.requires_grad}
    if optimizer is None or factors <= {1.0}:
        return
    if not any(LATENT_GROUP in group for group in optimizer.param_groups):
        warnings.warn(
            f"DKMConfig.latent_lr_scale={min(factors)} is not applied by this Trainer: the latent weights train at "
            "the full learning rate. Use hf_llmkit's LLMKitTrainer, or call "
            "hf_llmkit.quantization.scale_latent_lr(optimizer, model) on the optimizer you pass in `optimizers`.",
            stacklevel=2,
        )


def _layers(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, (DKMLinear, DKMEmbedding))]


def _calibrate_on(model: nn.Module, train_dataloader, args) -> None:
    samples = _calibration_samples(model)
    calibrate(model, first_examples(train_dataloader, samples, args.per_device_train_batch_size))


def _calibration_samples(model: nn.Module) -> int:
    layer = next((m for m in model.modules() if isinstance(m, DKMLinear)), None)
    return 0 if layer is None else layer.settings.config.calibration_samples


def _recipe(model: nn.Module) -> str:
    layer = next((m for m in model.modules() if isinstance(m, DKMLinear)), None)
    return "dkm" if layer is None else layer.settings.config.recipe


def add_training_state_callback(trainer) -> bool:
    """Add one `DKMTrainingStateCallback` to `trainer` when its model has trainable DKM layers and the trainer has none
    yet (what `LLMKitTrainer` does at construction); returns whether the trainer now has one."""
    callbacks = trainer.callback_handler.callbacks
    if any(isinstance(cb, DKMTrainingStateCallback) for cb in callbacks):
        return True
    if not any(isinstance(m, (DKMLinear, DKMEmbedding)) for m in trainer.model.modules()):
        return False
    trainer.add_callback(DKMTrainingStateCallback())
    return True


UNDECIDED_MESSAGE = (
    "this DKM model trains with its training state neither kept nor declined: pass "
    "callbacks=[hf_llmkit.quantization.DKMTrainingStateCallback()] to your Trainer / SFTTrainer (hf_llmkit's "
    "LLMKitTrainer adds it), or in a loop of your own call hf_llmkit.quantization.keep_training_state(model, True) "
    "(resumable checkpoints) or (model, False) (compact saves)"
)


def guard_training_state(model: nn.Module) -> None:
    """Make the first training forward of `model` (a model with trainable DKM layers) check that someone decided
    about its training state (see the module docstring); idempotent."""
    if not getattr(model, "_dkm_training_state_guard", False):
        model.register_forward_pre_hook(_check_decided)
        model._dkm_training_state_guard = True


def _check_decided(model: nn.Module, args) -> None:
    if not (model.training and torch.is_grad_enabled()):
        return
    layer = next((m for m in model.modules() if isinstance(m, (DKMLinear, DKMEmbedding))), None)
    if layer is None or layer.keep_training_state is not None:
        return
    if _calibration_samples(model):
        raise ValueError(f"DKMConfig(calibration_samples=...) would never run: {UNDECIDED_MESSAGE}")
    warnings.warn(f"Trainer checkpoints would not resume bit for bit: {UNDECIDED_MESSAGE}", stacklevel=2)
    keep_training_state(model, False)  # warned once: decided
