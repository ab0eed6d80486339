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


def default_lora_targets(peft_config: Any, model: Any) -> None:
    """LoRA without `--target_modules`: peft's own default for the model's family (`q_proj`, `v_proj` for Llama and
    Mixtral), set before injection. peft 0.21 reads its table only after turning an unset target list into an empty
    one on MoE models it converts from transformers 4 (Mixtral, so every `--upcycle_moe` run), and then matches
    nothing; a family without a default is refused here in one line naming the flag."""
    if getattr(peft_config, "peft_type", None) != "LORA" or peft_config.target_modules is not None:
        return
    if getattr(peft_config, "target_parameters", None):
        return
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    if targets is None:
        raise ValueError(
            f"--peft_method lora has no default --target_modules for a {model_type or type(model).__name__} model: "
            "pass --target_modules (e.g. --target_modules q_proj,v_proj)"
        )
    peft_config.target_modules = set(targets)


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
        default_lora_targets(peft_config, state.model)
        base_dir = adapter_base_dir(args)
        if base_dir is not None:  # the adapter's config points at the base saved next to it
            state.model.name_or_path = str(base_dir.resolve())
            state.base = (copy.deepcopy(state.model), copy.deepcopy(state.tokenizer))
        # P-tuning v1: the virtual tokens [P0].. join the tokenizer (saved with the adapter) before injection
        if args.peft.peft_method == "ptuning":
            state.template = PTuningTemplate(state.tokenizer, peft_config)
        state.model = get_peft_model(state.model, peft_config)

    def check(self, args) -> None:
        if not args.peft.merge_adapter:
            return
        if args.dkm.quantization is not None or args.kbit.load_in_kbits != 16:
            raise ValueError(
                "--merge_adapter folds the adapter into full-precision weights, and this run's base is quantized "
                "(--quantization dkm / --load_in_kbits): drop --merge_adapter, or merge in a run without quantization"
            )
        training = args.training
        zero3 = getattr(training, "hf_deepspeed_config", None) is not None and training.hf_deepspeed_config.is_zero3()
        if zero3 or training.fsdp:
            raise ValueError(
                "--merge_adapter merges one process's whole weights, and ZeRO-3 / FSDP shard them: drop "
                "--merge_adapter and merge the saved adapter afterwards (PeftModel.from_pretrained(base, adapter)"
                ".merge_and_unload())"
            )

    def finished(self, args, trainer) -> dict:
        """`--merge_adapter`: the adapter merged into the base weights, saved as a plain model (and the tokenizer)
        to output_dir/merged, written whole or not at all (a temporary folder renamed)."""
        if not args.peft.merge_adapter:
            return {}
        import shutil

        from hf_llmkit.data.cache import publish_once

        target = Path(args.training.output_dir) / "merged"
        if trainer.is_world_process_zero():
            merged = trainer.model.merge_and_unload()  # the last use of the adapter model: merged in place

            def write(folder: Path) -> None:
                merged.save_pretrained(folder)
                if trainer.processing_class is not None:
                    trainer.processing_class.save_pretrained(folder)

            shutil.rmtree(target, ignore_errors=True)  # an earlier run's merge of another adapter
            publish_once(target, write)
        return {"merged_model": str(target)}

    def describe(self, args):
        return args.peft.describe()


PEFT = Peft()
