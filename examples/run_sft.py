#!/usr/bin/env python
"""Supervised fine-tuning of a causal language model on instruction data with the HF Trainer: the second stage.

The seed recipe (Chinese-LLaMA-Alpaca-2) trains in two stages: pre-training (`run_clm.py`) and supervised
fine-tuning (its `run_clm_sft_with_peft.py`), which this command is. Records `{"instruction", "input", "output"}`
become a prompt (a template, Stanford Alpaca's by default) and a response; only the response is learned (every
prompt token has label -100), and each batch is padded (input_ids with the pad token, labels with -100, an
attention mask over the real tokens). Everything else is `run_clm.py`'s, shared through `hf_llmkit.cli.job`: the
same flags for the model, PEFT methods, DKM, bitsandbytes, MoE, sequence parallelism, DeepSpeed and fault tolerance,
the same callbacks, checkpoints, resume and results files. It runs with no arguments:

    python examples/run_sft.py                      # tiny Llama on the embedded instruction set (pydoc_data)
    python examples/run_sft.py --model_name_or_path outputs/run_clm --peft_method lora   # after pre-training
    python examples/run_sft.py --train_file data.jsonl --max_seq_length 512 --prompt_template alpaca
    accelerate launch --multi_gpu --num_processes 2 examples/run_sft.py --peft_method lora \\
        --deepspeed examples/ds_zero2_no_offload.json
    python examples/run_sft.py --help               # the options, grouped (--help-all: every TrainingArguments flag)

It ends with the validation loss on response tokens before and after training. Bad input (a record without
"output", a value that is not a string, a template without {instruction}) stops before any work with one line,
naming the line of the file, and exit status 2; so does a template without {input} for records that have inputs.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import hf_llmkit  # noqa: F401  # isort: skip  (first: its filters of upstream noise must precede peft importing bitsandbytes)
from datasets import Dataset

from hf_llmkit.cli import UsageError, job, usage_errors  # noqa: F401 (callers catch run_sft.UsageError)
from hf_llmkit.cli.arguments import InstructionDataArguments
from hf_llmkit.cli.checks import at_most
from hf_llmkit.cli.job import Args, Model
from hf_llmkit.cli.model_loading import context_length
from hf_llmkit.data.files import find_data_files
from hf_llmkit.data.instructions import instruction_records
from hf_llmkit.data.sft import (
    InstructionCollator,
    check_length_budget,
    pack_examples,
    read_instruction_records,
    tokenize_records,
)

logger = logging.getLogger("run_sft")

# What `python examples/run_sft.py` does with no flags, on top of `job.EMBEDDED_DEFAULTS` (each can be overridden;
# with features on the output folder is outputs/run_sft-<features>, see job.default_output_dir).
EMBEDDED_DEFAULTS = dict(
    job.EMBEDDED_DEFAULTS,
    max_steps=100,
    warmup_steps=10,
    logging_steps=10,
    save_steps=50,
    remove_unused_columns=False,  # the examples are input_ids + labels; the collator makes the attention mask
)
JOB = job.Job(
    prog="run_sft.py",
    description=__doc__.split("\n\n")[0],
    data_type=InstructionDataArguments,
    defaults=EMBEDDED_DEFAULTS,
)


def parse_args(argv: list[str] | None = None) -> Args:
    """The run's arguments; bad flags and flags of a feature that is off raise `UsageError`."""
    return job.parse_args(JOB, argv)


def check_inputs(args: Args) -> tuple[list[dict[str, str]], list[dict[str, str]] | None]:
    """Check and read the record files; return the training and validation records."""
    data = args.data
    if data.train_file is not None:
        records = read_instruction_records(find_data_files(train_file=data.train_file)[0])
    else:
        records = instruction_records()
    held_out = None
    if data.validation_file is not None:
        path = find_data_files(train_file=data.validation_file, flag="--validation_file")[0]
        held_out = read_instruction_records(path)
    for chosen in (records, held_out or []):  # a template without {input} would drop every input
        data.template.check_records(chosen)
    return records, held_out


def _split(records: list, held_out: list | None, percentage: float, seed: int) -> tuple[list, list]:
    if held_out is not None:
        return records, held_out
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    count = max(1, round(len(records) * percentage / 100))
    if count >= len(records):
        raise ValueError(
            f"{len(records)} records leave none to train on after holding out {percentage:g} percent; "
            "add records, lower --validation_split_percentage or pass --validation_file"
        )
    return [records[i] for i in sorted(order[count:])], [records[i] for i in sorted(order[:count])]


def _template_ids(built: Model) -> tuple[list[int], list[int]]:
    """P-tuning v1: the token ids its template puts before and after each example (never learned)."""
    if built.template is None:
        return [], []
    template = built.template
    if len(template.fields) != 1:
        raise ValueError(f"--ptuning_template {template.template!r} needs exactly one field around the example")
    before, after = template.format(**{template.fields[0]: "\0"}).split("\0")
    encode = lambda text: built.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []  # noqa: E731
    return encode(before), encode(after)


def prepare_datasets(args: Args, built: Model, inputs: tuple[list, list | None]) -> tuple[Any, Any]:
    """Tokenized examples for training and evaluation: labels -100 on every prompt token."""
    (records, held_out), data, training = inputs, args.data, args.training
    context = context_length(built.model.config)
    length = data.max_seq_length or min(256, context or 256)
    if context is not None and length > context:
        raise ValueError(
            f"--max_seq_length {length} is larger than the model's context ({context} positions); "
            f"pass --max_seq_length {context} or less"
        )
    train_records, eval_records = _split(records, held_out, data.validation_split_percentage, training.seed)
    wrap = _template_ids(built)
    check_length_budget(built.tokenizer, data.template, length, wrap=wrap)  # before tokenising: a flag conflict
    splits = []
    for name, chosen, limit in (("train", train_records, data.max_train_samples),
                                ("validation", eval_records, data.max_eval_samples)):  # fmt: skip
        examples, report = tokenize_records(
            chosen, built.tokenizer, template=data.template, max_seq_length=length, wrap=wrap
        )
        if report.describe(length) and training.should_log:
            logger.warning("%s: %s", name, report.describe(length))
        if report.empty_response:  # nothing to learn: a batch of only these would have no loss at all
            logger.warning("%s: %d records have an empty output and were left out", name, len(report.empty_response))
            empty = set(report.empty_response)
            examples = [example for i, example in enumerate(examples) if i not in empty]
        if not examples:
            raise ValueError(f"the {name} records have no output to learn; add records with a non-empty 'output'")
        if data.packing:
            examples = pack_examples(examples, length)
        flag = "--max_train_samples" if name == "train" else "--max_eval_samples"
        examples = examples[: at_most(limit, len(examples), flag=flag, what=f"{name} examples")]
        splits.append(Dataset.from_list(examples))
    logger.info("examples of up to %d tokens: %d train, %d validation", length, *map(len, splits))
    return tuple(splits)


STEPS = job.DataSteps(
    read=check_inputs,
    prepare=prepare_datasets,
    collator=lambda built: InstructionCollator(built.tokenizer.pad_token_id),
    loss_of="response tokens",
)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """The job; returns its results (also written to output_dir as *_results.json)."""
    return job.run_job(JOB, STEPS, argv)


def main() -> None:
    job.main(run, prog="run_sft.py")


if __name__ == "__main__":
    main()
