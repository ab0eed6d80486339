"""Trainer checkpoints of a DKM model that resume bit for bit, and a compact model at the end.

A compact DKM checkpoint (packed indices + lookup tables) is all inference needs, but not all training needs: the
latent weights hold more than their hard assignment. While `keep_training_state` is on, `save_pretrained` also
writes each DKM layer's latent `weight` and `centroids`, and loading such a checkpoint (the Trainer's resume, or
`from_pretrained`) restores them exactly. `DKMTrainingStateCallback` turns it on for the length of `Trainer.train()`,
so every `checkpoint-N` is resumable bit for bit and `trainer.save_model()` afterwards is compact again.

Nothing to add by hand: quantizing a model into trainable DKM layers (`from_pretrained(...,
quantization_config=DKMConfig())` or `quantize_model`) makes the callback one of every Trainer's default callbacks
(`install_default_callback`), so a plain `Trainer`, `LLMKitTrainer` and TRL's `SFTTrainer` all write resumable
checkpoints of a DKM model:

    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()                      # checkpoints: training state + packed export
    trainer.save_model("out")            # packed indices + lookup tables only
"""

from __future__ import annotations

from torch import nn
from transformers import TrainerCallback

from hf_llmkit.compat.transformers import add_default_trainer_callback
from hf_llmkit.quantization.calibration import calibrate, check_calibratable, first_examples
from hf_llmkit.quantization.layers import DKMEmbedding, DKMLinear


def keep_training_state(model: nn.Module, enabled: bool = True) -> int:
    """Make `save_pretrained` of `model` also write its DKM layers' training state; returns the number of layers."""
    layers = [m for m in model.modules() if isinstance(m, (DKMLinear, DKMEmbedding))]
    for layer in layers:
        layer.keep_training_state = enabled
    return len(layers)


class DKMTrainingStateCallback(TrainerCallback):
    """Keeps DKM's training state in the Trainer's checkpoints from `on_train_begin` to `on_train_end`.

    A run resumed from one of those checkpoints ends bitwise equal to an uninterrupted run; without this callback
    the checkpoints are compact and a resume restarts the latent weights from their hard assignment (a warning says
    so). A model without DKM layers is left alone. Every Trainer has it by default once a model has been quantized
    with trainable DKM layers (see the module docstring); passing it explicitly as well is harmless.

    With `DKMConfig(calibration_samples=N)` it also ends each run with `calibrate` on the first `N` training
    examples (in dataset order, the same on every rank and in a resumed run), so the model the Trainer saves last is
    GPTQ's rounding onto the trained tables; checkpoints written during the run keep the latent weights as trained.
    """

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            keep_training_state(model, True)
            if _calibration_samples(model):
                check_calibratable(model)  # fail before training, not after it

    def on_train_end(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if model is None:
            return
        keep_training_state(model, False)
        samples = _calibration_samples(model)
        if samples and train_dataloader is not None:
            calibrate(model, first_examples(train_dataloader, samples, args.per_device_train_batch_size))


def _calibration_samples(model: nn.Module) -> int:
    layer = next((m for m in model.modules() if isinstance(m, DKMLinear)), None)
    return 0 if layer is None else layer.settings.config.calibration_samples


def install_default_callback() -> None:
    """Make `DKMTrainingStateCallback` a default callback of every Trainer built from now on (idempotent; it does
    nothing for models without DKM layers)."""
    add_default_trainer_callback(DKMTrainingStateCallback)
