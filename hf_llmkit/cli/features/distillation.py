"""Distillation from the source: `--distill_from_source true` trains a DKM-compressed model on KL(source || model)
instead of the language-modelling loss (`hf_llmkit.trainers.distillation`, `LLMKitTrainer(teacher_model=...)`).

The source is the model as loaded from `--model_name_or_path` before quantization (in `--torch_dtype`), a second copy
in memory, frozen. What cannot distil is refused before any work, in one line: no `--quantization dkm` (the source
and the model are then one model: the loss is 0 and nothing trains), a model built from scratch or a compact DKM
checkpoint (no uncompressed source), a run that does not train, and the features that replace or shard the whole
logits the loss needs (sequence parallelism, `--tiled_loss`, label smoothing), P-tuning v1 (its virtual tokens are
not in the source's vocabulary) and DeepSpeed ZeRO-3 (it would partition the source as it loads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from hf_llmkit.cli.features.base import BuildState, Feature

__all__ = ["DISTILLATION", "DistillationArguments", "LOSS_OF"]

LOSS_OF = "KL(source || model), distillation from the source"
_DROP = "or drop --distill_from_source"


@dataclass
class DistillationArguments:
    """Which loss a compressing run trains on.

    Args:
        distill_from_source: Train the DKM model on KL(source || model) of the next-token distributions, the source
            being the model as loaded from `--model_name_or_path` before quantization (a second, frozen copy in
            memory), on the same batch and at the positions the LM loss scores; evaluation stays the LM loss.
    """

    help_group: ClassVar[str] = "DKM quantization"

    distill_from_source: bool = field(
        default=False,
        metadata={
            "help": "Train on KL(source || model), the source being --model_name_or_path before quantization (a "
            "second copy in memory); evaluation stays the LM loss."
        },
    )


def _refusal(args: Any) -> str | None:
    """Why this run cannot distil from its source (None: it can)."""
    from hf_llmkit.cli.features.dkm import dkm_checkpoint_config

    path, training = args.model.model_name_or_path, args.training
    if args.kbit.load_in_kbits != 16 and args.dkm.quantization != "dkm":
        return f"a --load_in_kbits {args.kbit.load_in_kbits} base is not supported: use --quantization dkm, {_DROP}"
    if args.dkm.quantization != "dkm":
        return (
            "without --quantization dkm the model is its source (the loss is 0 and nothing trains): add "
            f"--quantization dkm, {_DROP}"
        )
    if path is None:
        return f"a model built from scratch has no source: pass --model_name_or_path (a pretrained model), {_DROP}"
    saved = dkm_checkpoint_config(path)
    if saved is not None:
        return (
            f"--model_name_or_path {path} is a compact DKM checkpoint ({saved.bits}-bit), which holds no "
            f"uncompressed source: start from the uncompressed model, {_DROP}"
        )
    if not training.do_train:
        return f"it is a training loss and --do_train false trains nothing: {_DROP}"
    clashes = {
        f"--sequence_parallel_size {training.sequence_parallel_size} shards each sequence's logits over ranks": (
            training.sequence_parallel_size > 1
        ),
        "--tiled_loss never forms the whole logits": training.tiled_loss,
        "--label_smoothing_factor smooths the LM loss, which distillation replaces": training.label_smoothing_factor,
        "--peft_method ptuning adds virtual tokens the source does not have": args.peft.peft_method == "ptuning",
    }
    named = next((what for what, on in clashes.items() if on), None)
    if named is not None:
        return f"{named}: drop that flag, {_DROP}"
    config = getattr(training, "hf_deepspeed_config", None)
    if config is not None and config.is_zero3():
        return f"DeepSpeed ZeRO-3 would partition the source as it loads: use ZeRO-2 (or none), {_DROP}"
    return None


def load_source(args: Any, tokenizer: Any) -> Any:
    """The source model, as `--model_name_or_path` loads without quantization (RNG untouched, so the student's own
    start is the same with or without distillation)."""
    import torch
    from transformers import AutoConfig

    from hf_llmkit.cli.model_loading import load_model

    vocabulary = AutoConfig.from_pretrained(args.model.model_name_or_path).get_text_config().vocab_size
    if len(tokenizer) > vocabulary:  # load_model would add rows for them, random in each copy
        raise ValueError(
            f"--distill_from_source true: the tokenizer has {len(tokenizer)} tokens and the model {vocabulary}, and "
            f"the source knows nothing of the others: pass the model's own tokenizer, {_DROP}"
        )
    with torch.random.fork_rng(devices=[]):
        return load_model(args.model, tokenizer)


class Distillation(Feature):
    name = "distillation"
    arguments = DistillationArguments
    stage = 5  # loaded apart from the model (before it is upcycled or quantized); the order does not matter

    def check(self, args) -> None:
        if not args.distillation.distill_from_source:
            return
        reason = _refusal(args)
        if reason is not None:
            raise ValueError(f"--distill_from_source true: {reason}")

    def folder_suffix(self, values):
        return "distill" if values["distill_from_source"] else None

    def model_stage(self, args, state: BuildState) -> None:
        if args.distillation.distill_from_source:
            state.teacher = load_source(args, state.tokenizer)

    def train_results(self, args, examples, *, warn=False):
        return {"train_loss_of": LOSS_OF} if args.distillation.distill_from_source else {}


DISTILLATION = Distillation()
