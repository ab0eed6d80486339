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


def _check_mergeable(model: Any) -> None:
    """`--merge_adapter` saves a model `from_pretrained` reloads equal to the adapter model, or the run stops here,
    before training (`hf_llmkit.tuners.merging.merge_problem`)."""
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
    from hf_llmkit.quantization.tied import TiedDKMHead

    if not modules_to_save:
        return
    names = {id(m): n for n, m in model.named_modules()}
    for head_name, head in model.named_modules():
        if not isinstance(head, TiedDKMHead):
            continue
        for name in (head_name, names.get(id(head.embedding), "")):
            saved = next((m for m in modules_to_save if name == m or name.endswith(f".{m}")), None)
            if saved is not None:
                raise ValueError(
                    f"--modules_to_save {saved}: this model's {head_name} is its DKM-clustered input embedding "
                    "(--dkm_quantize_embeddings true on tied embeddings), one weight that a trained copy would split: "
                    f"drop {saved} from --modules_to_save, or pass --dkm_quantize_embeddings false"
                )


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

    def finished(self, args, trainer) -> dict:
        """`--merge_adapter`: the adapter merged into the base weights, saved as a plain model (and the tokenizer)
        to output_dir/merged, written whole or not at all (a temporary folder renamed)."""
        if not args.peft.merge_adapter:
            return {}
        import shutil

        from hf_llmkit.data.cache import publish_once
        from hf_llmkit.tuners.merging import untie_adapted_embeddings

        target = Path(args.training.output_dir) / "merged"
        if trainer.is_world_process_zero():
            untie_adapted_embeddings(trainer.model)  # a LoRA on a tied embedding: the output layer kept its weight
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
