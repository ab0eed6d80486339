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

import logging
from typing import Any

import hf_llmkit  # noqa: F401  # isort: skip  (first: its filters of upstream noise must precede peft importing bitsandbytes)
from transformers import default_data_collator as collate

from hf_llmkit.cli import UsageError, job, usage_errors  # noqa: F401 (callers catch run_clm.UsageError)
from hf_llmkit.cli.arguments import DataArguments, ModelArguments, resolve_block_size  # noqa: F401 (benchmarks)
from hf_llmkit.cli.checks import at_most
from hf_llmkit.cli.job import Args, Model
from hf_llmkit.cli.model_loading import load_model, load_tokenizer  # noqa: F401 (tests build the same model)
from hf_llmkit.data.blocks import build_lm_datasets
from hf_llmkit.data.corpus import corpus_texts, default_cache_dir
from hf_llmkit.data.files import TextFiles, find_data_files

logger = logging.getLogger("run_clm")

# What `python examples/run_clm.py` does with no flags, on top of `job.EMBEDDED_DEFAULTS` (each can be overridden;
# with features on the output folder is outputs/run_clm-<features>, see job.default_output_dir).
EMBEDDED_DEFAULTS = dict(job.EMBEDDED_DEFAULTS, max_steps=300, warmup_steps=20, logging_steps=20, save_steps=100)
JOB = job.Job(
    prog="run_clm.py", description=__doc__.split("\n\n")[0], data_type=DataArguments, defaults=EMBEDDED_DEFAULTS
)


def parse_args(argv: list[str] | None = None) -> Args:
    """The run's arguments; bad flags and flags of a feature that is off raise `UsageError`."""
    return job.parse_args(JOB, argv)


def check_inputs(args: Args) -> tuple[TextFiles | list[str], TextFiles | None]:
    """Check the data files; return the training and validation texts (files are streamed when tokenized)."""
    data = args.data
    files = find_data_files(dataset_dir=data.dataset_dir, train_file=data.train_file)
    texts = TextFiles(files, rows=data.text_rows) if files else corpus_texts()  # checked now, streamed when tokenized
    held_out = None
    if data.validation_file is not None:
        held_out = find_data_files(train_file=data.validation_file, flag="--validation_file")
        held_out = TextFiles(held_out, rows=data.text_rows)
    txt = [path.name for path in [*files, *(held_out.files if held_out else [])] if path.suffix == ".txt"]
    if not txt and "text_rows" in args.given:
        raise ValueError("--text_rows cuts .txt files into rows, and the data has none; drop --text_rows")
    if txt and args.training.should_log:  # how the text is cut decides what the model learns and the perplexity
        shown = ", ".join(txt[:3]) + (f" and {len(txt) - 3} more" if len(txt) > 3 else "")
        logger.info("%s: %s", shown, ROWS_SAID[data.text_rows])
    return texts, held_out


ROWS_SAID = {
    "line": "each non-blank line is a row followed by the end-of-text token (one document per line; wrapped prose "
    "reads better with --text_rows paragraph)",
    "paragraph": "each paragraph (lines between blank lines, joined by their line breaks) is a row followed by the "
    "end-of-text token",
}
_TRAIN = dict(flag="--max_train_samples", what="training blocks")
_EVAL = dict(flag="--max_eval_samples", what="validation blocks")


def prepare_datasets(args: Args, built: Model, inputs: tuple[list[str], list[str] | None]) -> tuple[Any, Any]:
    """Tokenized blocks for training and evaluation (cached; the first process builds them, the others load)."""
    (texts, held_out), data, training = inputs, args.data, args.training
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
        train = train.select(range(at_most(data.max_train_samples, len(train), **_TRAIN)))
    if data.max_eval_samples is not None:
        evaluation = evaluation.select(range(at_most(data.max_eval_samples, len(evaluation), **_EVAL)))
    if built.template is not None:  # P-tuning v1: each block is placed in the template ([Pk] not predicted)
        train, evaluation = built.template.wrap_blocks(train), built.template.wrap_blocks(evaluation)
    logger.info("blocks of %d tokens: %d train, %d validation", block_size, len(train), len(evaluation))
    return train, evaluation


STEPS = job.DataSteps(read=check_inputs, prepare=prepare_datasets, collator=lambda built: collate)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """The main job; returns its results (also written to output_dir as *_results.json)."""
    return job.run_job(JOB, STEPS, argv)


def main() -> None:
    job.main(run, prog="run_clm.py")


if __name__ == "__main__":
    main()
