#!/usr/bin/env python
"""Pre-train or continue training a causal language model with the HF Trainer: hf_llmkit's main job.

Modelled on the Chinese-LLaMA-Alpaca-2 recipe `run_clm_pt_with_peft.py`: `HfArgumentParser` over model,
data and training argument dataclasses; a text corpus tokenized and grouped into blocks with `datasets`
(cached), a train/validation split, training with the Trainer, evaluation perplexity, checkpoints and
resume. It runs with no arguments:

    python examples/run_clm.py                      # tiny Llama pre-trained from scratch on the embedded corpus
    accelerate launch --multi_gpu --num_processes 2 examples/run_clm.py        # the same on 2 ranks
    python examples/run_clm.py --model_name_or_path path/to/model --train_file corpus.txt --block_size 256
    python examples/run_clm.py --upcycle_moe true --moe_num_experts 8   # sparse upcycling to Mixtral
    python examples/run_clm.py --peft_method bottleneck --bottleneck_placement pfeiffer   # or lora, bitfit
    python examples/run_clm.py --peft_method ptuning_v2 --num_virtual_tokens 16 --prefix_projection true  # or ptuning

Without `--model_name_or_path` it builds a small Llama-architecture model from a config (sizes below) and
a byte-level BPE tokenizer trained on the English corpus that ships with Python (`pydoc_data.topics`).
Without `--dataset_dir` / `--train_file` it trains on that corpus. Re-running the same command resumes from
the newest checkpoint in `--output_dir`.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from peft import get_peft_model
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    default_data_collator,
    set_seed,
)

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.callbacks import (
    FaultToleranceCallback,
    LossScaleCallback,
    SavePeftModelCallback,
    latest_complete_checkpoint,
)
from hf_llmkit.corpus import corpus_texts, corpus_tokenizer, default_cache_dir
from hf_llmkit.lm_data import build_lm_datasets, find_data_files
from hf_llmkit.parallel.moe.arguments import MoEArguments
from hf_llmkit.trainers import LLMKitTrainer
from hf_llmkit.tuners.arguments import PeftArguments
from hf_llmkit.tuners.ptuning import PTuningTemplate

logger = logging.getLogger("run_clm")

# Embedded defaults: what `python examples/run_clm.py` does with no flags (each one can be overridden).
EMBEDDED_DEFAULTS = dict(
    output_dir="outputs/run_clm",
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
)


@dataclass
class ModelArguments:
    """Which model to train.

    Args:
        model_name_or_path: Local folder of a pretrained causal LM (config.json + weights). Omit it to pre-train
            the built-in tiny Llama from scratch.
        tokenizer_name_or_path: Tokenizer folder, when it is not the model folder.
        torch_dtype: dtype the weights are loaded in: auto, float32, bfloat16 or float16.
        attn_implementation: Attention implementation passed to the model (sdpa, eager, ...).
        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
            max_position_embeddings: sizes of the from-scratch Llama (ignored with `model_name_or_path`).
        quantization: "dkm" trains with DKM / eDKM weight clustering (`hf_llmkit.DKMConfig`, quantization-aware);
            the saved model holds packed n-bit indices + lookup tables. Use `--torch_dtype bfloat16` for eDKM's
            unique-value table (32-bit weights fall back to naive DKM's memory).
        dkm_bits, dkm_cluster_dim, dkm_granularity, dkm_group_size, dkm_embedding_bits, dkm_temperature, dkm_shard:
            the matching `DKMConfig` fields (`dkm_embedding_bits` set: embeddings are clustered too).
    """

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Local folder of a pretrained causal LM; omit to pre-train a tiny Llama."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer folder, when it is not the model folder."}
    )
    torch_dtype: str | None = field(
        default=None,
        metadata={"help": "dtype for the weights.", "choices": ["auto", "float32", "bfloat16", "float16"]},
    )
    attn_implementation: str | None = field(default=None, metadata={"help": "Attention implementation (sdpa, eager)."})
    vocab_size: int = field(default=4096, metadata={"help": "From scratch: BPE vocabulary trained on the corpus."})
    hidden_size: int = field(default=256, metadata={"help": "From scratch: hidden size."})
    intermediate_size: int = field(default=688, metadata={"help": "From scratch: MLP size."})
    num_hidden_layers: int = field(default=4, metadata={"help": "From scratch: decoder layers."})
    num_attention_heads: int = field(default=4, metadata={"help": "From scratch: query heads."})
    num_key_value_heads: int = field(default=2, metadata={"help": "From scratch: key/value heads (GQA)."})
    max_position_embeddings: int = field(default=512, metadata={"help": "From scratch: context length."})
    quantization: str | None = field(
        default=None, metadata={"help": "'dkm': DKM/eDKM train-time weight clustering.", "choices": ["dkm"]}
    )
    dkm_bits: int = field(default=3, metadata={"help": "DKM: bits per index (1-8)."})
    dkm_cluster_dim: int = field(default=1, metadata={"help": "DKM: weights per clustered vector."})
    dkm_granularity: str = field(
        default="per_tensor",
        metadata={
            "help": "DKM: one table per tensor or per group_size rows.",
            "choices": ["per_tensor", "per_grouped_channel"],
        },
    )
    dkm_group_size: int = field(default=32, metadata={"help": "DKM: output channels per table (per_grouped_channel)."})
    dkm_embedding_bits: int | None = field(
        default=None, metadata={"help": "DKM: also cluster embeddings, at these bits."}
    )
    dkm_temperature: float = field(default=0.02, metadata={"help": "DKM: soft-assignment temperature (x weight std)."})
    dkm_shard: bool = field(default=False, metadata={"help": "eDKM: shard the unique table across the ranks."})


@dataclass
class DataArguments:
    """What to train on.

    Args:
        dataset_dir: Folder of .txt / .json / .jsonl files (searched recursively); JSON rows need a `text` field.
        train_file: A single .txt / .json / .jsonl file (instead of `dataset_dir`).
        block_size: Tokens per training block; defaults to min(128, the model's context).
        validation_split_percentage: Share of the blocks held out for evaluation.
        data_cache_dir: Where tokenized, grouped datasets are cached (default: the hf_llmkit cache).
        preprocessing_num_workers: Processes for tokenization.
        max_train_samples / max_eval_samples: Truncate the splits (quick runs, tests).
    """

    dataset_dir: str | None = field(default=None, metadata={"help": "Folder of .txt/.json/.jsonl training files."})
    train_file: str | None = field(default=None, metadata={"help": "One .txt/.json/.jsonl training file."})
    block_size: int | None = field(default=None, metadata={"help": "Tokens per block (default min(128, context))."})
    validation_split_percentage: float = field(default=5.0, metadata={"help": "Percent of blocks held out."})
    data_cache_dir: str | None = field(default=None, metadata={"help": "Cache folder for processed datasets."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Tokenization processes."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many train blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use at most this many eval blocks."})

    def __post_init__(self):
        if self.dataset_dir is not None and self.train_file is not None:
            raise ValueError("pass either --dataset_dir or --train_file, not both")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"--block_size {self.block_size} is too small; use at least 2 tokens")


@dataclass
class RunArguments:
    """How this script treats an existing output folder.

    Args:
        overwrite_output_dir: Start from scratch even if `output_dir` holds checkpoints (default: resume).
        fault_tolerance: `FaultToleranceCallback`: manifest-checked checkpoints, save-and-exit on SIGTERM/SIGUSR1,
            rollback on NaN loss (`--no_fault_tolerance` turns it off).
        save_peft_adapter: `SavePeftModelCallback`: the PEFT adapter + tokenizer in every checkpoint and in
            output_dir/adapter (a no-op for full fine-tuning; `--no_save_peft_adapter` turns it off).
        log_loss_scale: `LossScaleCallback`: the live fp16 loss scale and overflows in the logs (nothing under
            bf16/fp32; `--no_log_loss_scale` turns it off).
    """

    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Ignore checkpoints in output_dir and train from scratch."}
    )
    fault_tolerance: bool = field(
        default=True, metadata={"help": "Manifest-checked checkpoints, save-and-exit on SIGTERM, NaN rollback."}
    )
    save_peft_adapter: bool = field(
        default=True, metadata={"help": "Save the PEFT adapter + tokenizer into every checkpoint and output_dir."}
    )
    log_loss_scale: bool = field(default=True, metadata={"help": "Log the live fp16 loss scale and overflows."})


def build_callbacks(run_args: RunArguments) -> list:
    """The hf_llmkit callbacks this run enables (all three by default)."""
    callbacks = []
    if run_args.fault_tolerance:
        callbacks.append(FaultToleranceCallback())
    if run_args.save_peft_adapter:
        callbacks.append(SavePeftModelCallback())
    if run_args.log_loss_scale:
        callbacks.append(LossScaleCallback())
    return callbacks


def parse_args(argv: list[str] | None = None):
    parser = HfArgumentParser(
        (ModelArguments, DataArguments, RunArguments, MoEArguments, PeftArguments, LLMKitTrainingArguments)
    )
    parser.set_defaults(**EMBEDDED_DEFAULTS)
    return parser.parse_args_into_dataclasses(args=argv)


def check_model_folders(model_args: ModelArguments) -> None:
    """Models and tokenizers are never downloaded: the folders given must exist locally."""
    if model_args.model_name_or_path is not None:
        path = Path(model_args.model_name_or_path)
        if not (path / "config.json").is_file():
            what = "does not exist" if not path.exists() else "has no config.json"
            raise ValueError(
                f"--model_name_or_path {path} {what}; pass a local model folder (models are not downloaded), "
                "or omit it to pre-train the built-in tiny Llama"
            )
    tokenizer = model_args.tokenizer_name_or_path
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise ValueError(f"--tokenizer_name_or_path {tokenizer} does not exist; pass a local tokenizer folder")


def load_tokenizer(model_args: ModelArguments):
    source = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if source is None:
        return corpus_tokenizer(vocab_size=model_args.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.sep_token
    if tokenizer.eos_token is None and tokenizer.sep_token is not None:
        tokenizer.eos_token = tokenizer.sep_token  # encoder tokenizers (BERT) end documents with [SEP]
    return tokenizer


def dkm_config(model_args: ModelArguments):
    """The `DKMConfig` of `--quantization dkm` (None without it); bad values raise ValueError naming the fix."""
    if model_args.quantization != "dkm":
        return None
    from hf_llmkit import DKMConfig

    return DKMConfig(
        bits=model_args.dkm_bits,
        cluster_dim=model_args.dkm_cluster_dim,
        granularity=model_args.dkm_granularity,
        group_size=model_args.dkm_group_size,
        quantize_embeddings=model_args.dkm_embedding_bits is not None,
        embedding_bits=model_args.dkm_embedding_bits or 8,
        temperature=model_args.dkm_temperature,
        shard=model_args.dkm_shard,
    )


def load_model(model_args: ModelArguments, tokenizer):
    quantization = dkm_config(model_args)
    dtype = model_args.torch_dtype
    dtype = dtype if dtype in (None, "auto") else getattr(torch, dtype)
    if model_args.model_name_or_path is None:
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=model_args.hidden_size,
            intermediate_size=model_args.intermediate_size,
            num_hidden_layers=model_args.num_hidden_layers,
            num_attention_heads=model_args.num_attention_heads,
            num_key_value_heads=model_args.num_key_value_heads,
            max_position_embeddings=model_args.max_position_embeddings,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=False,
        )
        if model_args.attn_implementation:
            config._attn_implementation = model_args.attn_implementation
        model = LlamaForCausalLM(config)
        model = model.to(dtype) if isinstance(dtype, torch.dtype) else model
        if quantization is not None:
            from hf_llmkit.quantization import quantize_model

            model = quantize_model(model, quantization)
        return model
    path = Path(model_args.model_name_or_path)
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "is_decoder", True) is False:
        config.is_decoder = True  # encoder checkpoints (BERT family) train causally as decoders
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    return model


def context_length(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_block_size(data_args: DataArguments, config) -> int:
    context = context_length(config)
    if data_args.block_size is None:
        return min(128, context or 128)
    if context is not None and data_args.block_size > context:
        raise ValueError(
            f"--block_size {data_args.block_size} is larger than the model's context ({context} positions); "
            f"pass --block_size {context} or less"
        )
    return data_args.block_size


def resume_checkpoint(run_args: RunArguments, training_args) -> str | None:
    """The checkpoint to resume from: an explicit `--resume_from_checkpoint`, else the newest *complete* one in
    output_dir (manifest-verified: half-written checkpoints of a killed run are skipped)."""
    if training_args.resume_from_checkpoint is not None:
        if not Path(training_args.resume_from_checkpoint).is_dir():
            raise ValueError(
                f"--resume_from_checkpoint {training_args.resume_from_checkpoint} is not a folder; "
                "pass a checkpoint-N folder, or omit it to resume from the newest checkpoint in --output_dir"
            )
        return training_args.resume_from_checkpoint
    if run_args.overwrite_output_dir or not os.path.isdir(training_args.output_dir):
        return None
    return latest_complete_checkpoint(training_args.output_dir)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 50 else float("inf")


def results_table(rows: list[tuple[str, str]]) -> str:
    rows = [("result", "value"), *rows]
    left, right = (max(len(row[i]) for row in rows) for i in (0, 1))
    lines = [f"| {k.ljust(left)} | {v.ljust(right)} |" for k, v in rows]
    lines.insert(1, f"|{'-' * (left + 2)}|{'-' * (right + 2)}|")
    return "\n".join(lines)


class UsageError(Exception):
    """Bad command-line input; `main` prints it as one line and exits with status 2."""


def run(argv: list[str] | None = None) -> dict:
    start = time.perf_counter()
    try:
        model_args, data_args, run_args, moe_args, peft_args, training_args = parse_args(argv)
    except ValueError as err:  # raised by the argument dataclasses' __post_init__
        raise UsageError(err) from err
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not training_args.should_log:
        logger.setLevel(logging.WARNING)
    transformers.utils.logging.set_verbosity_warning()
    set_seed(training_args.seed)

    try:  # everything the user's input decides is checked before any work starts
        files = find_data_files(dataset_dir=data_args.dataset_dir, train_file=data_args.train_file)
        check_model_folders(model_args)
        tokenizer = load_tokenizer(model_args)
        model = load_model(model_args, tokenizer)
        model = moe_args.apply(model)  # --upcycle_moe: dense -> Mixtral / Qwen2-MoE experts
        peft_config = peft_args.build_config()  # None: --peft_method none trains every weight
        # P-tuning v1: add the virtual tokens [P0].. to the tokenizer (saved with the adapter) before injection
        template = PTuningTemplate(tokenizer, peft_config) if peft_args.peft_method == "ptuning" else None
        if peft_config is not None:
            model = get_peft_model(model, peft_config)
            model.print_trainable_parameters()
        block_size = resolve_block_size(data_args, model.config)
        checkpoint = resume_checkpoint(run_args, training_args)
    except ValueError as err:
        raise UsageError(err) from err

    with training_args.main_process_first(desc="tokenize and group"):
        datasets = build_lm_datasets(
            tokenizer=tokenizer,
            block_size=block_size,
            files=files,
            texts=None if files else corpus_texts(),
            validation_split_percentage=data_args.validation_split_percentage,
            cache_dir=data_args.data_cache_dir or default_cache_dir() / "datasets",
            num_proc=data_args.preprocessing_num_workers,
            seed=training_args.seed,
        )
    train_dataset, eval_dataset = datasets["train"], datasets["validation"]
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(data_args.max_train_samples, len(train_dataset))))
    if data_args.max_eval_samples is not None:
        eval_dataset = eval_dataset.select(range(min(data_args.max_eval_samples, len(eval_dataset))))
    if template is not None:  # P-tuning v1: every block is placed in the template (same length, [Pk] not predicted)
        train_dataset, eval_dataset = template.wrap_blocks(train_dataset), template.wrap_blocks(eval_dataset)
    logger.info("blocks of %d tokens: %d train, %d validation", block_size, len(train_dataset), len(eval_dataset))

    trainer = LLMKitTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        callbacks=build_callbacks(run_args),
    )
    results: dict = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "block_size": block_size,
        "output_dir": training_args.output_dir,
    }
    if training_args.do_eval and checkpoint is None:
        results["eval_perplexity_before"] = perplexity(trainer.evaluate()["eval_loss"])
    if training_args.do_train:
        if checkpoint is not None:
            logger.info("resuming from %s", checkpoint)
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        trainer.save_state()
        results["train_loss"] = train_result.training_loss
        results["global_step"] = trainer.state.global_step
        results["resumed_from"] = checkpoint
    if training_args.do_eval:
        metrics = trainer.evaluate()
        results["eval_loss"] = metrics["eval_loss"]
        results["eval_perplexity"] = perplexity(metrics["eval_loss"])
        trainer.save_metrics("eval", metrics)
    results["wall_time_s"] = time.perf_counter() - start
    if trainer.is_world_process_zero():
        print_results(results, training_args.world_size)
    return results


def print_results(results: dict, world_size: int) -> None:
    def fmt(key: str, spec: str = ".3f") -> str:
        value = results.get(key)
        return "-" if value is None else format(value, spec)

    rows = [
        ("parameters (trainable)", f"{results['parameters']:,} ({results['trainable_parameters']:,})"),
        ("ranks", str(world_size)),
        ("steps", str(results.get("global_step", "-"))),
        ("train loss", fmt("train_loss")),
        ("eval perplexity before", fmt("eval_perplexity_before", ".2f")),
        ("eval perplexity after", fmt("eval_perplexity", ".2f")),
        ("wall time", f"{results['wall_time_s']:.1f} s"),
        ("outputs", results["output_dir"]),
    ]
    if results.get("resumed_from"):
        rows.insert(3, ("resumed from", results["resumed_from"]))
    print("\n" + results_table(rows), flush=True)


def main() -> None:
    try:
        run()
    except UsageError as err:
        # Bad input: one line that says what to change, no traceback.
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
        sys.exit(2)
    finally:
        # Tear the process groups down before interpreter exit: gloo groups (the sequence-parallel ones too)
        # destroyed during finalisation can abort the process ("terminate called without an active exception").
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
