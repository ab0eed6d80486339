"""The base a main job's PEFT adapter trains on, saved next to it when it exists nowhere else (`output_dir/base`).

`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), out / "adapter")` is the model the
run evaluated. The base is written before training (peft's adapter saves read its config), into a temporary folder
renamed into place (`hf_llmkit.data.cache.replace_folder`), so a run killed while writing it leaves no base, only a
temporary that the next run in the folder removes (the resumed run writes the base again).

A DKM base keeps its layers' training state (latent weights and tables, next to the packed export): it reloads as
trainable DKM layers, `nn.Linear`s every PEFT method wraps (a compact checkpoint's packed layers are none) and that
compute what the run did. A PEFT adapter freezes their parameters, yet their state still changes during the run:
DKM's calibration (the recipe's before the first step, `--dkm_recipe calibrated`, or `--dkm_calibration_samples`'
after the last) and the layers' own updates in training forwards (a calibrated recipe with block scales changed
the evaluated model after the start's base was written: tests/examples/test_run_clm_adapter_base.py, cell
dkm-recipe-bottleneck). `BaseAfterCalibration` writes the base again from the model's layers after the start's
calibration and when training ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_llmkit.data.cache import replace_folder

__all__ = ["BaseAfterCalibration", "refresh_dkm_base", "write_base"]


def write_base(model: Any, tokenizer: Any, folder: Path) -> None:
    """Save `model` (a DKM model with its layers' training state) and `tokenizer` to `folder`, all or nothing."""
    from hf_llmkit.quantization import keep_training_state

    keep_training_state(model, True)

    def write(temporary: Path) -> None:
        model.save_pretrained(temporary)
        tokenizer.save_pretrained(temporary)

    replace_folder(folder, write)


def _plain_name(name: str) -> str:
    """A module's name in the base model: without peft's wrapper prefix and `base_layer` hops."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def refresh_dkm_base(model: Any, folder: Path) -> int:
    """Write the base in `folder` again with the DKM layers' state (latent weights, tables, scales) of `model`, the
    PEFT model trained on it; returns the number of layers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_llmkit.quantization.integration import TRAINABLE

    live = {_plain_name(n): m for n, m in model.named_modules() if isinstance(m, TRAINABLE)}
    base = AutoModelForCausalLM.from_pretrained(folder)
    count = 0
    for name, layer in base.named_modules():
        if isinstance(layer, TRAINABLE):
            layer.load_state_dict(live[name].state_dict(), strict=False)
            count += 1
    write_base(base, AutoTokenizer.from_pretrained(folder), folder)
    return count


class BaseAfterCalibration(TrainerCallback):
    """Writes a DKM adapter base again after the start's calibration and when training ends, from the layers the run
    evaluates (added after the trainer's `DKMTrainingStateCallback`, so its calibration has run)."""

    def __init__(self, folder: Path, *, at_start: bool) -> None:
        self.folder, self.at_start = folder, at_start

    def _refresh(self, args, model) -> None:
        if args.should_save and model is not None:
            refresh_dkm_base(model, self.folder)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.at_start and state.global_step == 0:
            self._refresh(args, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._refresh(args, model)
