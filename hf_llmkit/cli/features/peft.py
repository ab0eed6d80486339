"""PEFT: `--peft_method` and its options (`hf_llmkit.cli.peft`), wrapping the built model in the adapter last."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from hf_llmkit.cli.features.base import BuildState, Feature
from hf_llmkit.cli.model_loading import ties_embeddings
from hf_llmkit.cli.peft import PeftArguments

__all__ = ["PEFT", "adapter_base_dir"]


def adapter_base_dir(args: Any) -> Path | None:
    """output_dir/base for a PEFT run whose base exists nowhere else: built from scratch, or changed after loading
    (upcycled into experts, DKM-clustered); else None (the adapter points at `--model_name_or_path`)."""
    if args.peft.peft_method == "none":
        return None
    changed = args.moe.upcycle_moe or args.dkm.quantization == "dkm"
    if args.model.model_name_or_path is not None and not changed:
        return None
    return Path(args.training.output_dir) / "base"


class Peft(Feature):
    name = "peft"
    arguments = PeftArguments
    stage = 50  # last: the adapter wraps the model every other stage built
    row = "method"

    def folder_suffix(self, values):
        return values["peft_method"] if values["peft_method"] != "none" else None

    def model_stage(self, args, state: BuildState) -> None:
        from peft import get_peft_model

        from hf_llmkit.tuners.ptuning import PTuningTemplate

        peft_config = args.peft.build_config(tied_embeddings=ties_embeddings(state.model))
        if peft_config is None:
            return
        base_dir = adapter_base_dir(args)
        if base_dir is not None:  # the adapter's config points at the base saved next to it
            state.model.name_or_path = str(base_dir.resolve())
            state.base = (copy.deepcopy(state.model), copy.deepcopy(state.tokenizer))
        # P-tuning v1: the virtual tokens [P0].. join the tokenizer (saved with the adapter) before injection
        if args.peft.peft_method == "ptuning":
            state.template = PTuningTemplate(state.tokenizer, peft_config)
        state.model = get_peft_model(state.model, peft_config)

    def describe(self, args):
        return args.peft.describe()


PEFT = Peft()
