#!/usr/bin/env python
"""Pre-train or continue training a causal language model with the HF Trainer: hf_llmkit's main job.

Modelled on transformers' `run_clm.py` and the Chinese-LLaMA-Alpaca-2 recipe `run_clm_pt_with_peft.py` (whose
flags it accepts with their meaning): model, data and training arguments parsed by `HfArgumentParser`; a text
corpus tokenized and grouped into blocks with `datasets` (cached); a train/validation split or a held-out file;
the Trainer with hf_llmkit's callbacks; evaluation perplexity; results files; checkpoints and resume. It runs
with no arguments:

    python examples/run_clm.py                      # tiny Llama pre-trained from scratch on the embedded corpus
    accelerate launch --multi_gpu --num_processes 2 examples/run_clm.py        # the same on 2 ranks
    python examples/run_clm.py --model_name_or_path path/to/model --train_file corpus.txt --block_size 256
    python examples/run_clm.py --peft_method lora --trainable q_proj,v_proj --modules_to_save embed_tokens,lm_head
    python examples/run_clm.py args.json            # the flags as one JSON object
    python examples/run_clm.py --help               # our options, grouped (--help-all: every TrainingArguments flag)

Without `--model_name_or_path` it builds a small model of `--model_type` (llama) from a config and a byte-level
BPE tokenizer trained on the English corpus that ships with Python (`pydoc_data.topics`). Each combination of
features gets its own default output folder (outputs/run_clm, outputs/run_clm-lora, ...); re-running the same
command resumes from the newest complete checkpoint there (`LLMKitTrainingArguments.auto_resume`). Bad input
stops before any work with one line and exit status 2.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

import hf_llmkit  # noqa: F401  # isort: skip  (first: its filters of upstream noise must precede peft importing bitsandbytes)
from peft import get_peft_model
from transformers import default_data_collator as collate
from transformers import set_seed

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.callbacks import TrainingDivergedError
from hf_llmkit.checkpoints.lock import hold_output_dir
from hf_llmkit.cli import FlagGroup, UsageError, exit_on_error, usage_errors  # noqa: F401 (callers catch run_clm.UsageError)
from hf_llmkit.cli.arguments import SCRATCH_SIZES, DataArguments, ModelArguments, RunArguments, resolve_block_size
from hf_llmkit.cli.folders import (
    check_checkpoint_folder,
    check_json_file,
    check_model_folder,
    check_tokenizer_folder,
    check_writable_folder,
)
from hf_llmkit.cli.help import HelpLayout
from hf_llmkit.cli.model_loading import load_model, load_tokenizer, ties_embeddings
from hf_llmkit.cli.output import configure_console, keep_tensorboard_in_output_dir
from hf_llmkit.cli.parser import CommandLineParser
from hf_llmkit.cli.results import (
    ResumePoint,
    count_parameters,
    describe_setup,
    perplexity,
    results_table,
    save_results,
)
from hf_llmkit.corpus import corpus_texts, default_cache_dir
from hf_llmkit.data_files import TextFiles, find_data_files
from hf_llmkit.lm_data import build_lm_datasets
from hf_llmkit.parallel.moe.arguments import MoEArguments
from hf_llmkit.quantization.arguments import DKMArguments, KbitArguments
from hf_llmkit.trainers import LLMKitTrainer
from hf_llmkit.tuners.arguments import PeftArguments
from hf_llmkit.tuners.ptuning import PTuningTemplate

logger = logging.getLogger("run_clm")
DIVERGED_EXIT_CODE = 3  # the loss diverged after --max_rollbacks rollbacks: not bad input, not a crash

# What `python examples/run_clm.py` does with no flags (each one can be overridden).
EMBEDDED_DEFAULTS = dict(
    output_dir="outputs/run_clm",  # with features on: outputs/run_clm-<features> (see default_output_dir)
    do_train=True,
    do_eval=True,
    max_steps=300,
    per_device_train_batch_size=8,
    per_device_eval_batch_size=16,
    learning_rate=1e-3,
    lr_scheduler_type="cosine",
    warmup_steps=20,
    weight_decay=0.01,
    logging_steps=20,
    save_steps=100,
    save_total_limit=2,
    report_to="none",
    disable_tqdm=False,
    dataloader_pin_memory=torch.cuda.is_available(),
    seed=42,
    auto_resume=True,
    ddp_find_unused_parameters=False,  # every trainable weight takes part in each step (MoE experts are fused tensors)
)


class Args(NamedTuple):
    """Every parsed argument of one run, and the flags the user typed."""

    model: ModelArguments
    data: DataArguments
    peft: PeftArguments
    dkm: DKMArguments
    kbit: KbitArguments
    moe: MoEArguments
    run: RunArguments
    training: LLMKitTrainingArguments
    given: frozenset[str] = frozenset()


HELP = HelpLayout(
    order=("model", "quantization", "DKM quantization", "data", "PEFT", "mixture of experts", "sequence parallel",
           "fault tolerance", "training"),
    training_title="training",
    training_flags=("output_dir", "max_steps", "num_train_epochs", "per_device_train_batch_size",
                    "per_device_eval_batch_size", "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type",
                    "warmup_steps", "warmup_ratio", "weight_decay", "logging_steps", "save_steps", "save_total_limit",
                    "eval_strategy", "eval_steps", "seed", "fp16", "bf16", "activation_checkpointing", "deepspeed",
                    "ddp_find_unused_parameters", "resume_from_checkpoint", "report_to", "do_train", "do_eval"),
)  # fmt: skip
# The seed recipe's spellings that transformers 5 deprecated: same meaning, no deprecation warning.
SEED_SPELLINGS = {"--gradient_checkpointing": "--activation_checkpointing"}
CROSS_FLAGS = (FlagGroup("--upcycle_moe true", ("moe_aux_loss_coef", "moe_z_loss_coef"), lambda v: v["upcycle_moe"]),)


def default_output_dir(values: dict[str, Any]) -> str:
    """outputs/run_clm, plus one suffix per switched-on feature, so different runs never share a folder."""
    parts = []
    if values["model_name_or_path"]:
        parts.append(Path(values["model_name_or_path"]).name)
    if values["peft_method"] != "none":
        parts.append(values["peft_method"])
    if values["quantization"]:
        parts.append(values["quantization"])
    if values["load_in_kbits"] != 16:
        parts.append(f"{values['load_in_kbits']}bit")
    if values["upcycle_moe"]:
        parts.append("moe")
    if values["sequence_parallel_size"] > 1:
        parts.append(f"sp{values['sequence_parallel_size']}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        parts.append(f"{world}ranks")
    return "-".join(["outputs/run_clm", *parts])


def _derived_defaults(values: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """Defaults that follow from what was typed (a typed flag always wins)."""
    if "warmup_ratio" in given and "warmup_steps" in given:
        raise UsageError("pass --warmup_ratio or --warmup_steps, not both (a --warmup_steps below 1 is a ratio)")
    derived = {"output_dir": default_output_dir(values), "auto_resume": not values["overwrite_output_dir"]}
    if "num_train_epochs" in given:
        derived["max_steps"] = -1  # the epochs decide the length, not the embedded default of 300 steps
    if values["warmup_ratio"] is not None:
        derived["warmup_steps"] = values["warmup_ratio"]
    return derived


def _check_deepspeed_file(values: dict[str, Any]) -> None:
    if isinstance(values["deepspeed"], str) and not values["deepspeed"].lstrip().startswith("{"):
        check_json_file(values["deepspeed"], flag="--deepspeed")


def parse_args(argv: list[str] | None = None) -> Args:
    """The run's arguments; bad flags and flags of a feature that is off raise `UsageError`."""
    types = [ModelArguments, DataArguments, PeftArguments, DKMArguments, KbitArguments, MoEArguments, RunArguments]
    parser = CommandLineParser(
        [*types, LLMKitTrainingArguments], layout=HELP, flag_groups=CROSS_FLAGS, prog="run_clm.py",
        description=__doc__.split("\n\n")[0], renamed_flags=SEED_SPELLINGS,
    )  # fmt: skip
    parser.set_defaults(**EMBEDDED_DEFAULTS)
    parsed, given = parser.parse(argv, derived_defaults=_derived_defaults, prechecks=[_check_deepspeed_file])
    args = Args(*parsed, given=frozenset(given))
    with usage_errors():
        check_combinations(args)
    return args


def check_combinations(args: Args) -> None:
    """Features that cannot work together stop here, before any work."""
    if args.kbit.load_in_kbits != 16:
        if args.peft.peft_method == "none":
            raise ValueError(
                f"--load_in_kbits {args.kbit.load_in_kbits} freezes the quantized base: train an adapter on it "
                "with --peft_method (e.g. lora), or drop --load_in_kbits"
            )
        if args.dkm.quantization is not None:
            raise ValueError("--load_in_kbits 4/8 and --quantization dkm both quantize the weights; choose one")
        if args.moe.upcycle_moe:
            raise ValueError(
                "--upcycle_moe copies full-precision MLP weights into experts, --load_in_kbits 4/8 loads them "
                "quantized; drop one"
            )
        if args.model.model_name_or_path is None:
            raise ValueError("--load_in_kbits 4/8 quantizes a pretrained model: add --model_name_or_path")


def check_inputs(args: Args) -> tuple[list[str], list[str] | None]:
    """Check every folder and file the run reads or writes; return the training and validation texts."""
    model, data, training = args.model, args.data, args.training
    if model.model_name_or_path is not None:
        check_model_folder(model.model_name_or_path)
    if model.tokenizer_name_or_path is not None:
        check_tokenizer_folder(model.tokenizer_name_or_path)
    if training.resume_from_checkpoint is not None:
        check_checkpoint_folder(training.resume_from_checkpoint)
    files = find_data_files(dataset_dir=data.dataset_dir, train_file=data.train_file)
    texts = TextFiles(files) if files else corpus_texts()  # checked now, streamed when tokenized
    held_out = None
    if data.validation_file is not None:
        held_out = TextFiles(find_data_files(train_file=data.validation_file, flag="--validation_file"))
    cache_flag = "--data_cache_dir" if data.data_cache_dir else "the hf_llmkit cache ($HF_LLMKIT_CACHE)"
    check_writable_folder(data.data_cache_dir or default_cache_dir(), flag=cache_flag)
    check_writable_folder(training.output_dir, flag="--output_dir")
    return texts, held_out


class Model(NamedTuple):
    """The model to train and what the run needs to know about how it was built."""

    model: Any
    tokenizer: Any
    template: Any = None  # P-tuning v1: places each block in the template
    base: Any = None  # from-scratch PEFT runs: (base model, tokenizer) the adapter trains on (write_adapter_base)


def adapter_base_dir(args: Args) -> Path | None:
    """output_dir/base for a PEFT run on a model built from scratch (the base exists nowhere else), else None."""
    if args.peft.peft_method == "none" or args.model.model_name_or_path is not None:
        return None
    return Path(args.training.output_dir) / "base"


def build_model(args: Args, tokenizer) -> Model:
    """Load or build the model, then quantize, upcycle and wrap it in the PEFT adapter, as the flags say."""
    model_args = args.model
    quantization = args.dkm.build_config()
    if quantization is None and args.kbit.load_in_kbits != 16:
        compute = getattr(torch, model_args.torch_dtype) if model_args.torch_dtype not in (None, "auto") else None
        quantization = args.kbit.build_config(
            compute_dtype=compute or torch.float32, skip_modules=args.peft.modules_to_save
        )
    required = [name for name in SCRATCH_SIZES if name in args.given]
    # Experts are copies of full-precision MLPs: with --upcycle_moe, DKM clusters the upcycled model.
    dkm_after_upcycle = args.dkm.quantization is not None and args.moe.upcycle_moe
    loaded_with = None if dkm_after_upcycle else quantization
    model = load_model(model_args, tokenizer, quantization_config=loaded_with, required=required)
    model = args.moe.apply(model)  # --upcycle_moe: dense -> Mixtral / Qwen2-MoE experts
    if dkm_after_upcycle:
        from hf_llmkit.quantization import quantize_model

        model = quantize_model(model, quantization)
    if args.training.sequence_parallel_size > 1:
        from hf_llmkit.parallel.sequence.ulysses import kv_replication

        heads = model.config.num_attention_heads  # the heads must split over the ranks of a sequence
        kv_heads = getattr(model.config, "num_key_value_heads", None) or heads
        kv_replication(heads, kv_heads, args.training.sequence_parallel_size)
    peft_config = args.peft.build_config(tied_embeddings=ties_embeddings(model))
    if peft_config is None:
        return Model(model, tokenizer)
    base_dir = adapter_base_dir(args)
    base = None
    if base_dir is not None:  # the adapter's config points at the base saved next to it
        model.name_or_path = str(base_dir.resolve())
        base = (copy.deepcopy(model), copy.deepcopy(tokenizer))
    # P-tuning v1: the virtual tokens [P0].. join the tokenizer (saved with the adapter) before injection
    template = PTuningTemplate(tokenizer, peft_config) if args.peft.peft_method == "ptuning" else None
    if args.kbit.load_in_kbits != 16:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=args.training.activation_checkpointing
        )
    model = get_peft_model(model, peft_config)
    return Model(model, tokenizer, template, base)


def prepare_datasets(args: Args, built: Model, texts: list[str], held_out: list[str] | None) -> tuple[Any, Any]:
    """Tokenized blocks for training and evaluation (cached; the first process builds them, the others load)."""
    data, training = args.data, args.training
    block_size = resolve_block_size(data, built.model.config)
    with training.main_process_first(desc="tokenize and group"):
        datasets = build_lm_datasets(
            tokenizer=built.tokenizer,
            block_size=block_size,
            texts=texts,
            validation_texts=held_out,
            validation_split_percentage=data.validation_split_percentage,
            cache_dir=data.data_cache_dir or default_cache_dir() / "datasets",
            num_proc=data.preprocessing_num_workers,
            seed=training.seed,
        )
    train, evaluation = datasets["train"], datasets["validation"]
    if data.max_train_samples is not None:
        train = train.select(range(min(data.max_train_samples, len(train))))
    if data.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(data.max_eval_samples, len(evaluation))))
    if built.template is not None:  # P-tuning v1: each block is placed in the template ([Pk] not predicted)
        train, evaluation = built.template.wrap_blocks(train), built.template.wrap_blocks(evaluation)
    logger.info("blocks of %d tokens: %d train, %d validation", block_size, len(train), len(evaluation))
    return train, evaluation


def build_trainer(args: Args, built: Model, train, evaluation) -> LLMKitTrainer:
    run, training = args.run, args.training
    callbacks = [ResumePoint(), *run.build_callbacks(peft=args.peft.peft_method != "none", fp16=training.fp16)]
    trainer = LLMKitTrainer(
        model=built.model,
        args=training,
        train_dataset=train if training.do_train else None,
        eval_dataset=evaluation if training.do_eval else None,
        processing_class=built.tokenizer,
        data_collator=collate,
        callbacks=callbacks,
    )
    keep_tensorboard_in_output_dir(trainer)
    return trainer


def _resuming(training: LLMKitTrainingArguments) -> bool:
    """Whether `train()` will resume: an explicit checkpoint, or auto-resume with a checkpoint in output_dir."""
    if training.resume_from_checkpoint is not None:
        return True
    return training.auto_resume and any(path.is_dir() for path in Path(training.output_dir).glob("checkpoint-*"))


def train_and_evaluate(args: Args, trainer: LLMKitTrainer) -> dict[str, Any]:
    """Evaluate before (new runs), train (resuming when output_dir holds this run's checkpoint), evaluate after;
    writes train_results.json, eval_results.json and all_results.json as transformers' run_clm does."""
    training, results = args.training, {}
    # DeepSpeed builds its engine in train(): ZeRO-1/2 cannot evaluate before it (transformers refuses)
    if training.do_eval and not _resuming(training) and not training.deepspeed:
        results["eval_perplexity_before"] = perplexity(trainer.evaluate()["eval_loss"])
    if training.do_train:
        outcome = trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
        trainer.save_model()
        metrics = save_results(trainer, "train", {**outcome.metrics, "train_samples": len(trainer.train_dataset)})
        trainer.save_state()
        start = next(cb.step for cb in trainer.callback_handler.callbacks if isinstance(cb, ResumePoint))
        results.update(train_loss=metrics["train_loss"], global_step=trainer.state.global_step, resumed_at=start)
        results["resumed_from"] = trainer.resumed_from
    if training.do_eval:
        metrics = trainer.evaluate()
        metrics = save_results(trainer, "eval", {**metrics, "eval_samples": len(trainer.eval_dataset)})
        results.update(eval_loss=metrics["eval_loss"], eval_perplexity=metrics["perplexity"])
    return results


def write_adapter_base(args: Args, built: Model) -> Path | None:
    """Save the base model + tokenizer the adapter trains on to output_dir/base (a new run; a resumed one has it),
    so `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), out / "adapter")` reproduces
    the evaluated model. Written before training: peft's adapter saves read the base's config."""
    base_dir = adapter_base_dir(args)
    if base_dir is None:
        return None
    with args.training.main_process_first(desc="adapter base"):
        if args.training.should_save and not (_resuming(args.training) and (base_dir / "config.json").is_file()):
            base_model, base_tokenizer = built.base
            base_model.save_pretrained(base_dir)
            base_tokenizer.save_pretrained(base_dir)
    return base_dir


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """The main job; returns its results (also written to output_dir as *_results.json)."""
    start = time.perf_counter()
    args = parse_args(argv)
    configure_console(main_process=args.training.should_log)
    set_seed(args.training.seed)
    with usage_errors(OSError):  # everything the input decides is checked before training starts
        texts, held_out = check_inputs(args)
        # one run per output folder: a second run into it stops here, before any work (held until the job ends)
        lock = hold_output_dir(args.training.output_dir, main=args.training.process_index == 0)
        try:
            built = build_model(args, load_tokenizer(args.model))
            train, evaluation = prepare_datasets(args, built, texts, held_out)
        except BaseException:
            lock.release(clean=True)  # rejected before any work: no output folder left behind
            raise
    base_dir = write_adapter_base(args, built)
    built = built._replace(base=None)  # the snapshot is on disk now
    trainer = build_trainer(args, built, train, evaluation)
    total, trainable = count_parameters(built.model)
    results: dict[str, Any] = {"parameters": total, "trainable_parameters": trainable}
    results.update(train_and_evaluate(args, trainer))
    results.update(output_dir=args.training.output_dir, wall_time_s=time.perf_counter() - start)
    results["adapter_base"] = str(base_dir) if base_dir is not None else None
    if trainer.is_world_process_zero():
        setup = describe_setup(peft=args.peft, dkm=args.dkm, kbit=args.kbit, moe=args.moe, training=args.training)
        print("\n" + results_table(setup, results), flush=True)
    return results


def main() -> None:
    try:
        exit_on_error(run, prog="run_clm.py", exit_codes={TrainingDivergedError: DIVERGED_EXIT_CODE})
    finally:
        # Tear the process groups down before interpreter exit: gloo groups (the sequence-parallel ones too)
        # destroyed during finalisation can abort the process ("terminate called without an active exception").
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
