"""DKM: `--quantization dkm` and its `--dkm_*` options (`hf_llmkit.cli.quantization`): the model is loaded
DKM-quantized, or, built from scratch or upcycled into experts first, quantized by `quantize_model` here (the one
call of it in the main jobs).

A compact DKM checkpoint as `--model_name_or_path` continues its DKM training: its packed layers (which hold no
weight to train) become trainable DKM layers with its tables (`trainable_from_packed`), under the settings of its
`config.json`; without `--quantization dkm`, or with a `--dkm_*` flag that contradicts those settings, it is refused
before any work. `--dkm_recipe calibrated` fills the fields left at their defaults with its own values: a flag typed
at its default value would be replaced silently, so it is refused, naming the flag.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_llmkit.cli.features.base import BuildState, Feature
from hf_llmkit.cli.quantization import DKM_OPTIONS, DKMArguments

__all__ = ["DKM", "dkm_checkpoint_config"]

# What each field of DKMConfig is called on the command line.
_FLAGS = {option.field: option.flag for option in DKM_OPTIONS}


def dkm_checkpoint_config(path: str | None):
    """The `DKMConfig` of a compact DKM checkpoint folder, None for any other folder (or one whose config.json does
    not read: the folder checks report that)."""
    if path is None:
        return None
    try:
        saved = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    quantization = saved.get("quantization_config") if isinstance(saved, dict) else None
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "dkm":
        return None
    from hf_llmkit.quantization import DKMConfig

    return DKMConfig.from_dict(quantization)


def _shown(value) -> str:
    if isinstance(value, list):
        return ",".join(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _continue_checkpoint(args, saved) -> None:
    """Make the run's DKM settings the checkpoint's; a typed flag that says otherwise is refused."""
    path = args.model.model_name_or_path
    if args.dkm.quantization != "dkm":
        raise ValueError(
            f"--model_name_or_path {path} is a compact DKM checkpoint ({saved.bits}-bit packed layers, which train "
            "only as DKM layers); add --quantization dkm (its settings come from its config.json)"
        )
    ours = args.dkm.dkm_config
    for field, flag in _FLAGS.items():
        if flag in args.given and getattr(ours, field) != getattr(saved, field):
            raise ValueError(
                f"--{flag} {_shown(getattr(args.dkm, flag))}: --model_name_or_path {path} is a compact DKM checkpoint "
                f"with {field}={_shown(getattr(saved, field))} (its config.json); drop --{flag}"
            )
    for field, flag in _FLAGS.items():  # the flag record and the results table show the checkpoint's settings
        setattr(args.dkm, flag, getattr(saved, field))
    args.dkm.dkm_config, args.dkm.continued_from = saved, path


def _check_recipe_flags(args) -> None:
    """`--dkm_recipe calibrated` keeps a field only when it differs from the default: a flag typed at its default
    would be replaced by the recipe's value without a word."""
    config = args.dkm.dkm_config
    if config is None or config.recipe != "calibrated":
        return
    for field, flag in _FLAGS.items():
        typed = getattr(args.dkm, flag)
        if flag in args.given and typed != getattr(config, field):
            raise ValueError(
                f"--dkm_recipe calibrated replaces --{flag} {_shown(typed)} with {_shown(getattr(config, field))}: "
                f"a setting left at its default is the recipe's; drop --{flag}, give it another value, or drop "
                "--dkm_recipe calibrated"
            )


class Dkm(Feature):
    name = "dkm"
    arguments = DKMArguments
    stage = 20  # after the MoE upcycle: the experts are copies of full-precision MLPs, then clustered
    row = "quantization"

    def check(self, args) -> None:
        saved = dkm_checkpoint_config(args.model.model_name_or_path)
        if saved is not None:
            _continue_checkpoint(args, saved)
        else:
            _check_recipe_flags(args)

    def folder_suffix(self, values):
        return values["quantization"]

    def load_config(self, args):
        """The `DKMConfig` a pretrained dense model is loaded with (its quantizer clusters it while loading); None
        for a compact DKM checkpoint (loaded as saved, then made trainable)."""
        config = args.dkm.build_config()
        if config is None or args.model.model_name_or_path is None or args.moe.upcycle_moe:
            return None
        if getattr(args.dkm, "continued_from", None):
            return None
        return config

    def model_stage(self, args, state: BuildState) -> None:
        config = args.dkm.build_config()
        if config is None or state.loaded_with is config:
            return
        from hf_llmkit.quantization import quantize_model, trainable_from_packed

        if not getattr(args.dkm, "continued_from", None):
            state.model = quantize_model(state.model, config)
        else:  # a compact checkpoint's packed layers; a Trainer checkpoint's training state loads trainable already
            trainable_from_packed(state.model)

    def train_results(self, args, examples, *, warn=False):
        return args.dkm.calibration(examples, warn=warn)

    def describe(self, args):
        return args.dkm.describe()


DKM = Dkm()
