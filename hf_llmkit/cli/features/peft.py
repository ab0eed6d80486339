"""PEFT: `--peft_method` and its options (`hf_llmkit.cli.peft`), wrapping the built model in the adapter last."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from hf_llmkit.cli.features.base import BuildState, Feature
from hf_llmkit.cli.model_loading import ties_embeddings
from hf_llmkit.cli.peft import PeftArguments

__all__ = ["PEFT", "adapter_base_dir"]


def _merged_dir(args: Any) -> Path:
    return Path(args.training.output_dir) / "merged"


def adapter_base_dir(args: Any) -> Path | None:
    """output_dir/base for a PEFT run whose base exists nowhere else: built from scratch, or changed after loading
    (upcycled into experts, DKM-clustered); else None (the adapter points at `--model_name_or_path`)."""
    if args.peft.peft_method == "none":
        return None
    changed = args.moe.upcycle_moe or args.dkm.quantization == "dkm"
    if args.model.model_name_or_path is not None and not changed:
        return None
    return Path(args.training.output_dir) / "base"


def _check_mergeable(model: Any) -> None:
    """`--merge_adapter` saves a model `from_pretrained` reloads equal to the adapter model, or the run stops here,
    before training: a `--lora_bias true` LoRA needs a bias in every adapted layer to fold it into (peft's merge
    fails after training otherwise), and `hf_llmkit.tuners.merging.merge_problem` names what a reload would lose."""
    from peft.tuners.lora import LoraLayer

    without = [
        name
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
        and any(module.lora_bias.values())
        and getattr(module.get_base_layer(), "bias", None) is None
    ]
    if without:
        shown = ", ".join(n.removeprefix("base_model.model.") for n in without[:2]) + (", ..." if without[2:] else "")
        raise ValueError(
            f"--lora_bias true with --merge_adapter: merging folds the LoRA bias into each adapted layer's bias, and "
            f"{len(without)} adapted layers have none ({shown}): drop --lora_bias, or --merge_adapter"
        )

    from hf_llmkit.tuners.merging import merge_problem

    problem = merge_problem(model)
    if problem is None:
        return
    from torch import nn

    has_biases = any(isinstance(m, nn.Linear) and m.bias is not None for m in model.get_base_model().modules())
    existing = "pass --bitfit_add_missing_biases false (train its existing biases only), or " if has_biases else ""
    raise ValueError(f"--merge_adapter: {problem}: {existing}drop --merge_adapter (the adapter is saved either way)")


def _check_clustered_tie_kept(model: Any, modules_to_save: Any) -> None:
    """An LM head that is its DKM-clustered embedding (`TiedDKMHead`) and that embedding are one weight: a trained
    full copy of either (`--modules_to_save`) would split them, so it is refused before training."""
    from hf_llmkit.quantization.tied import tied_heads

    if not modules_to_save:
        return
    for head_name, embedding_name in tied_heads(model).items():
        for name in (head_name, embedding_name):
            saved = next((m for m in modules_to_save if name == m or name.endswith(f".{m}")), None)
            if saved is not None:
                raise ValueError(
                    f"--modules_to_save {saved}: this model's {head_name} is its DKM-clustered input embedding "
                    "(--dkm_quantize_embeddings true on tied embeddings), one weight that a trained copy would split: "
                    f"drop {saved} from --modules_to_save, or pass --dkm_quantize_embeddings false"
                )


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
        _check_clustered_tie_kept(state.model, getattr(peft_config, "modules_to_save", None))
        default_lora_targets(peft_config, state.model)
        base_dir = adapter_base_dir(args)
        if base_dir is not None:  # the adapter's config points at the base saved next to it
            state.model.name_or_path = str(base_dir.resolve())
            state.base = (copy.deepcopy(state.model), copy.deepcopy(state.tokenizer))
        # P-tuning v1: the virtual tokens [P0].. join the tokenizer (saved with the adapter) before injection
        if args.peft.peft_method == "ptuning":
            state.template = PTuningTemplate(state.tokenizer, peft_config)
        state.model = get_peft_model(state.model, peft_config)
        if args.peft.merge_adapter:
            _check_mergeable(state.model)

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

    def check_folders(self, args) -> None:
        """`--merge_adapter` writes the folder output_dir/merged: a file or a symlink there is refused (a symlink may
        point at any folder, the user's own model too: the merge never replaces what it points at)."""
        if not args.peft.merge_adapter:
            return
        from hf_llmkit.data.cache import not_a_folder

        target = _merged_dir(args)
        what = not_a_folder(target)
        if what is not None:
            raise ValueError(
                f"--merge_adapter writes the merged model to the folder {target}, and that is {what}: remove it, or "
                "pass another --output_dir"
            )

    def finished(self, args, trainer) -> dict:
        """`--merge_adapter`: the adapter merged into the base weights, saved as a plain model (and the tokenizer)
        to output_dir/merged, written whole or not at all (a temporary folder renamed; an earlier run's merge of
        another adapter removed first). A disk-full or permission error ends the run with one line and exit status
        74 (`CheckpointWriteError`), nothing left under merged/; the adapter and the results are saved by then."""
        if not args.peft.merge_adapter:
            return {}
        import shutil

        from hf_llmkit.checkpoints.endings import CheckpointWriteError, logged
        from hf_llmkit.checkpoints.retries import describe_write_error
        from hf_llmkit.data.cache import replace_folder
        from hf_llmkit.tuners.merging import merge_for_saving

        target = _merged_dir(args)
        if trainer.is_world_process_zero():
            merged = merge_for_saving(trainer.model)  # the last use of the adapter model: merged in place

            def write(folder: Path) -> None:
                merged.save_pretrained(folder)
                if trainer.processing_class is not None:
                    trainer.processing_class.save_pretrained(folder)

            try:
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)  # an earlier run's merge of another adapter (and room for this one)
                replace_folder(target, write)
            except Exception as err:
                reason = describe_write_error(err, target.parent)
                if reason is None:
                    raise
                message = (
                    f"could not write the merged model into {target}: {reason}; no merged model is there, and the "
                    f"trained adapter is saved in {args.training.output_dir}: free space and run the command again"
                )
                raise logged(CheckpointWriteError(message), is_main_process=True) from err
        return {"merged_model": str(target)}

    def describe(self, args):
        return args.peft.describe()


PEFT = Peft()
