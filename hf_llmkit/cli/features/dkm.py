"""DKM: `--quantization dkm` and its `--dkm_*` options (`hf_llmkit.cli.quantization`): the model is loaded
DKM-quantized, or, built from scratch or upcycled into experts first, quantized by `quantize_model` here (the one
call of it in the main jobs)."""

from __future__ import annotations

from hf_llmkit.cli.features.base import BuildState, Feature
from hf_llmkit.cli.quantization import DKMArguments

__all__ = ["DKM"]


class Dkm(Feature):
    name = "dkm"
    arguments = DKMArguments
    stage = 20  # after the MoE upcycle: the experts are copies of full-precision MLPs, then clustered
    row = "quantization"

    def folder_suffix(self, values):
        return values["quantization"]

    def load_config(self, args):
        """The `DKMConfig` a pretrained dense model is loaded with (its quantizer clusters it while loading)."""
        config = args.dkm.build_config()
        if config is None or args.model.model_name_or_path is None or args.moe.upcycle_moe:
            return None
        return config

    def model_stage(self, args, state: BuildState) -> None:
        config = args.dkm.build_config()
        if config is not None and state.loaded_with is not config:
            from hf_llmkit.quantization import quantize_model

            state.model = quantize_model(state.model, config)

    def train_results(self, args, examples, *, warn=False):
        return args.dkm.calibration(examples, warn=warn)

    def describe(self, args):
        return args.dkm.describe()


DKM = Dkm()
