"""Distillation from the source: `--distill_from_source true` trains a DKM-compressed model on KL(source || model)
instead of the language-modelling loss (`hf_llmkit.trainers.distillation`, `LLMKitTrainer(teacher_model=...)`).

The source is the model as loaded from `--model_name_or_path` before quantization (in `--torch_dtype`), a second copy
in memory, frozen; `--teacher_model_name_or_path` names another folder when that one is not it (a compact DKM
checkpoint continued from its uncompressed source, or any model of the same vocabulary: then the run needs no
quantization). What cannot distil is refused before any work, in one line: without a teacher folder, no
`--quantization dkm` (the source and the model are then one model: the loss is 0 and nothing trains), a model built
from scratch or a compact DKM checkpoint (no uncompressed source); a compact teacher, or one of another vocabulary;
a `--load_in_kbits` base; a run that does not train; the features that replace or shard the whole logits the loss
needs (sequence parallelism, `--tiled_loss`, label smoothing); P-tuning v1 (its virtual tokens are not in the
source's vocabulary) and DeepSpeed ZeRO-3 (it would partition the source as it loads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from hf_llmkit.cli.feature_flags import FlagGroup
from hf_llmkit.cli.features.base import BuildState, Feature

__all__ = ["DISTILLATION", "DistillationArguments", "loss_of"]

_DROP = "or drop --distill_from_source"
_TEACHER = "--teacher_model_name_or_path"


def loss_of(teacher: str | None) -> str:
    """What a distilled run's `train_loss` is (its results say)."""
    if teacher is None:
        return "KL(source || model), distillation from the source"
    return f"KL(teacher || model), distillation from {teacher}"


def _vocabulary(path: str | None) -> int | None:
    """The vocabulary size a model folder's config.json declares (None: no folder or no readable config; the folder
    checks report that)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")) if path else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return size if isinstance(size, int) else None


@dataclass
class DistillationArguments:
    """Which loss a compressing run trains on.

    Args:
        distill_from_source: Train the DKM model on KL(source || model) of the next-token distributions, the source
            being the model as loaded from `--model_name_or_path` before quantization (a second, frozen copy in
            memory), on the same batch and at the positions the LM loss scores; evaluation stays the LM loss.
        teacher_model_name_or_path: The source to distil from when `--model_name_or_path` is not it (a compact DKM
            checkpoint continued from its uncompressed model; any model of the same vocabulary).
    """

    help_group: ClassVar[str] = "DKM quantization"
    flag_groups: ClassVar[tuple[FlagGroup, ...]] = (
        FlagGroup("--distill_from_source true", ("teacher_model_name_or_path",), lambda v: v["distill_from_source"]),
    )

    distill_from_source: bool = field(
        default=False,
        metadata={
            "help": "Train on KL(source || model); source: --model_name_or_path unquantized, a 2nd copy in memory."
        },
    )
    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "The source, if not --model_name_or_path (same vocabulary)."},
    )


def _refusal(args: Any) -> str | None:
    """Why this run cannot distil from its source (None: it can)."""
    from hf_llmkit.cli.features.dkm import dkm_checkpoint_config

    path, training = args.model.model_name_or_path, args.training
    teacher = args.distillation.teacher_model_name_or_path
    if args.kbit.load_in_kbits != 16:
        return f"a --load_in_kbits {args.kbit.load_in_kbits} base is not supported: use --quantization dkm, {_DROP}"
    if teacher is None and args.dkm.quantization != "dkm":
        return (
            "without --quantization dkm the model is its source (the loss is 0 and nothing trains): add "
            f"--quantization dkm, or name another model with {_TEACHER}, {_DROP}"
        )
    if teacher is None and path is None:
        return (
            "a model built from scratch has no source: pass --model_name_or_path (a pretrained model) or "
            f"{_TEACHER}, {_DROP}"
        )
    saved = dkm_checkpoint_config(path)
    if teacher is None and saved is not None:
        return (
            f"--model_name_or_path {path} is a compact DKM checkpoint ({saved.bits}-bit), which holds no "
            f"uncompressed source: pass that source as {_TEACHER}, {_DROP}"
        )
    if teacher is not None and dkm_checkpoint_config(teacher) is not None:
        return f"{_TEACHER} {teacher} is a compact DKM checkpoint: pass the uncompressed model, {_DROP}"
    sizes = (_vocabulary(teacher), _vocabulary(path))
    if teacher is not None and None not in sizes and sizes[0] != sizes[1]:
        return f"{_TEACHER} {teacher} has a vocabulary of {sizes[0]} tokens and the model {sizes[1]}: {_DROP}"
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
    import dataclasses

    import torch
    from transformers import AutoConfig

    from hf_llmkit.cli.model_loading import load_model

    path = args.distillation.teacher_model_name_or_path or args.model.model_name_or_path
    vocabulary = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    if len(tokenizer) > vocabulary:  # load_model would add rows for them, random in each copy
        raise ValueError(
            f"--distill_from_source true: the tokenizer has {len(tokenizer)} tokens and the source {vocabulary}, and "
            f"the source knows nothing of the others: pass the source's own tokenizer, {_DROP}"
        )
    with torch.random.fork_rng(devices=[]):
        return load_model(dataclasses.replace(args.model, model_name_or_path=path), tokenizer)


def _check_same_vocabulary(source: Any, model: Any) -> None:
    """A teacher folder's logits must have the model's width (a model built from scratch is known only now)."""
    ours, theirs = (m.config.get_text_config().vocab_size for m in (model, source))
    if ours != theirs:
        raise ValueError(
            f"--distill_from_source true: the teacher's vocabulary has {theirs} tokens and the model's {ours}: pass "
            f"a teacher of the model's vocabulary as {_TEACHER}, {_DROP}"
        )


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

    def check_folders(self, args) -> None:
        teacher = args.distillation.teacher_model_name_or_path
        if args.distillation.distill_from_source and teacher is not None:
            from hf_llmkit.cli.folders import check_model_folder

            check_model_folder(teacher, flag=_TEACHER)

    def folder_suffix(self, values):
        return "distill" if values["distill_from_source"] else None

    def model_stage(self, args, state: BuildState) -> None:
        if args.distillation.distill_from_source:
            state.teacher = load_source(args, state.tokenizer)
            _check_same_vocabulary(state.teacher, state.model)

    def train_results(self, args, examples, *, warn=False):
        on = args.distillation.distill_from_source
        return {"train_loss_of": loss_of(args.distillation.teacher_model_name_or_path)} if on else {}


DISTILLATION = Distillation()
