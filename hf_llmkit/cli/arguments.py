"""The model, data and run arguments of a causal-LM training command (`HfArgumentParser`-ready).

`examples/run_clm.py` parses them next to `PeftArguments`, `DKMArguments`, `KbitArguments`, `MoEArguments` and
`LLMKitTrainingArguments`. Each dataclass titles its `--help` group (`help_group` / `help_groups`), lists the flags
that only act with a feature switched on (`flag_groups`, see `hf_llmkit.cli.feature_flags`), declares the bounds of
its numbers in the field metadata (`ge` / `gt` / `le` / `lt`, checked before any work by `hf_llmkit.cli.checks`)
and checks the rest in `__post_init__` with a `ValueError` that names the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from hf_llmkit.cli.feature_flags import FlagGroup
from hf_llmkit.cli.model_loading import SIZE_FLAGS, context_length
from hf_llmkit.data.files import TXT_ROWS

__all__ = [
    "SCRATCH_SIZES", "DataArguments", "InstructionDataArguments", "ModelArguments", "RunArguments",
    "resolve_block_size",
]  # fmt: skip

SCRATCH_SIZES = SIZE_FLAGS
SCRATCH_FLAGS = ("model_type", "config_overrides", *SCRATCH_SIZES)
_COUNT = {"ge": 1, "bound_hint": "omit it for no limit"}  # bounds of an optional count (hf_llmkit.cli.checks)


_SPLIT = FlagGroup(
    "a split of the training data",
    ("validation_split_percentage",),
    lambda v: v["validation_file"] is None,
    when_off="with --validation_file (that file is the validation set)",
)


@dataclass
class ModelArguments:
    """Which model to train.

    Args:
        model_name_or_path: Local folder of a pretrained causal LM (config.json + weights); encoder checkpoints
            (BERT) train as decoders. Omit it to pre-train a model of `model_type` from scratch.
        tokenizer_name_or_path: Tokenizer folder, when it is not the model folder.
        model_type: From scratch: the architecture (any transformers causal LM: llama, mistral, qwen2, gpt2...).
        config_overrides: From scratch: `key=value,key=value` applied to the config last (as transformers' run_clm).
        vocab_size: From scratch without a tokenizer folder: the vocabulary of the BPE trained on the corpus.
        hidden_size ... max_position_embeddings: From scratch: the model's sizes.
        torch_dtype: dtype the weights are loaded in: auto, float32, bfloat16 or float16.
        attn_implementation: Attention implementation passed to the model (sdpa, eager, ...).
    """

    help_group: ClassVar[str] = "model"
    flag_groups: ClassVar[tuple[FlagGroup, ...]] = (
        FlagGroup(
            "training from scratch",
            SCRATCH_FLAGS,
            lambda v: v["model_name_or_path"] is None,
            when_off="with --model_name_or_path (its config.json defines the model)",
        ),
        FlagGroup(
            "the built-in tokenizer",
            ("vocab_size",),
            lambda v: v["model_name_or_path"] is None and v["tokenizer_name_or_path"] is None,
            when_off="with --model_name_or_path or --tokenizer_name_or_path (the tokenizer sets the vocabulary)",
        ),
    )

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Local folder of a pretrained causal LM; omit to pre-train from scratch."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer folder, when it is not the model folder."}
    )
    model_type: str = field(default="llama", metadata={"help": "From scratch: the architecture (llama, qwen2...)."})
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "From scratch: config changes, e.g. 'rms_norm_eps=1e-5,tie_word_embeddings=true'."},
    )
    vocab_size: int = field(
        default=4096, metadata={"help": "From scratch: BPE vocabulary trained on the corpus.", "ge": 300}
    )
    hidden_size: int = field(default=256, metadata={"help": "From scratch: hidden size.", "ge": 1})
    intermediate_size: int = field(default=688, metadata={"help": "From scratch: MLP size.", "ge": 1})
    num_hidden_layers: int = field(default=4, metadata={"help": "From scratch: decoder layers.", "ge": 1})
    num_attention_heads: int = field(default=4, metadata={"help": "From scratch: query heads.", "ge": 1})
    num_key_value_heads: int = field(default=2, metadata={"help": "From scratch: key/value heads (GQA).", "ge": 1})
    max_position_embeddings: int = field(default=512, metadata={"help": "From scratch: context length.", "ge": 2})
    torch_dtype: str | None = field(
        default=None,
        metadata={
            "help": "dtype of the weights (default: float32).",
            "choices": ["auto", "float32", "bfloat16", "float16"],
        },
    )
    attn_implementation: str | None = field(default=None, metadata={"help": "Attention implementation (sdpa, eager)."})


@dataclass
class DataArguments:
    """What to train on.

    Args:
        dataset_dir: Folder of .txt / .json / .jsonl files (searched below); JSON rows need a string `text`.
        train_file: A single .txt / .json / .jsonl file (instead of `dataset_dir`).
        validation_file: A held-out file to evaluate on (instead of splitting the training blocks).
        text_rows: What a row of a .txt file is: "line" (each non-blank line, as the seed recipe reads a corpus of
            one document per line) or "paragraph" (the lines between blank lines, joined by their line breaks: wrapped
            prose). Each row is followed by the end-of-text token.
        block_size: Tokens per training block; defaults to min(128, the model's context).
        validation_split_percentage: Percent of the blocks held out for evaluation (at least one block), as in
            transformers' run_clm. The seed script passes its value to `train_test_split` as a fraction: its
            `0.05` is 5 percent here.
        data_cache_dir: Where tokenized, grouped datasets are cached (default: the hf_llmkit cache).
        preprocessing_num_workers: Processes for tokenization.
        max_train_samples / max_eval_samples: Truncate the splits (quick runs, tests).
    """

    help_group: ClassVar[str] = "data"
    flag_groups: ClassVar[tuple[FlagGroup, ...]] = (_SPLIT,)

    dataset_dir: str | None = field(default=None, metadata={"help": "Folder of .txt/.json/.jsonl training files."})
    train_file: str | None = field(default=None, metadata={"help": "One .txt/.json/.jsonl training file."})
    validation_file: str | None = field(default=None, metadata={"help": "A held-out .txt/.json/.jsonl file."})
    text_rows: str = field(
        default="line",
        metadata={
            "help": "A .txt row (each followed by the end-of-text token): 'line' (one document per line) or "
            "'paragraph' (lines between blank lines, joined: wrapped prose).",
            "choices": list(TXT_ROWS),
        },
    )
    block_size: int | None = field(
        default=None, metadata={"help": "Tokens per block (default min(128, context)).", "ge": 2}
    )
    validation_split_percentage: float = field(
        default=5.0,
        metadata={
            "help": "Percent of blocks held out.", "gt": 0, "lt": 100,
            "bound_hint": "e.g. 5 holds out 5 percent of the blocks, or pass --validation_file",
        },
    )  # fmt: skip
    data_cache_dir: str | None = field(default=None, metadata={"help": "Cache folder for processed datasets."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Tokenization processes.", **_COUNT})
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Use at most this many train blocks.", **_COUNT}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Use at most this many eval blocks.", **_COUNT}
    )

    def __post_init__(self):
        if self.dataset_dir is not None and self.train_file is not None:
            raise ValueError("pass either --dataset_dir or --train_file, not both")


@dataclass
class InstructionDataArguments:
    """What a supervised fine-tuning command trains on (`examples/run_sft.py`; `hf_llmkit.data.sft`).

    Args:
        train_file: A .json (array) or .jsonl file of `{"instruction", "input", "output"}` records ("input" may be
            left out); default: the embedded instruction set (`hf_llmkit.data.instructions`).
        validation_file: Held-out records to evaluate on (instead of splitting the training records).
        prompt_template: "alpaca" (Stanford Alpaca's prompt, with and without an input), or a format string with
            `{instruction}` and `{input}`; the response follows it.
        max_seq_length: Tokens per example (prompt + response), default min(256, the model's context); longer
            records keep their response when they can.
        packing: Concatenate consecutive examples into sequences of up to `max_seq_length` tokens (off: one
            example per sequence, padded per batch).
        validation_split_percentage: Percent of the records held out for evaluation (at least one record).
        max_train_samples / max_eval_samples: Truncate the splits (quick runs, tests).
    """

    help_group: ClassVar[str] = "data"
    flag_groups: ClassVar[tuple[FlagGroup, ...]] = (_SPLIT,)

    train_file: str | None = field(
        default=None, metadata={"help": "A .json/.jsonl file of {instruction, input, output} records."}
    )
    validation_file: str | None = field(default=None, metadata={"help": "Held-out records (.json/.jsonl)."})
    prompt_template: str = field(
        default="alpaca", metadata={"help": "'alpaca', or a format string with {instruction} and {input}."}
    )
    max_seq_length: int | None = field(
        default=None, metadata={"help": "Tokens per example, prompt + response (default min(256, context)).", "ge": 2}
    )
    packing: bool = field(default=False, metadata={"help": "Concatenate examples into max_seq_length sequences."})
    validation_split_percentage: float = field(
        default=10.0, metadata={"help": "Percent of records held out.", "gt": 0, "lt": 100}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many records.", **_COUNT})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluate on at most this many records.", **_COUNT}
    )

    def __post_init__(self):
        from hf_llmkit.data.sft import PromptTemplate

        self.template = PromptTemplate.parse(self.prompt_template)  # a bad template stops here, before any work


@dataclass
class RunArguments:
    """How this run treats an existing output folder, and which hf_llmkit callbacks it uses.

    Args:
        overwrite_output_dir: Start from scratch even if `output_dir` holds checkpoints (default: resume).
        fault_tolerance: `FaultToleranceCallback`: manifest-checked checkpoints, save-and-exit on SIGTERM/SIGUSR1,
            rollback on NaN loss (`--fault_tolerance false` turns it off).
        save_peft_adapter: `SavePeftModelCallback`: the PEFT adapter + tokenizer in every checkpoint and in
            output_dir/adapter.
        log_loss_scale: `LossScaleCallback`: the live fp16 loss scale and overflows in the logs (fp16 runs).
        warmup_ratio: The seed recipe's `--warmup_ratio`: warm up over this share of the steps (transformers 5
            reads a `--warmup_steps` below 1 as that ratio; pass one or the other).
    """

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "fault tolerance": ("overwrite_output_dir", "fault_tolerance"),
        "PEFT": ("save_peft_adapter",),
        "training": ("log_loss_scale", "warmup_ratio"),
    }
    flag_groups: ClassVar[tuple[FlagGroup, ...]] = (
        FlagGroup("a --peft_method", ("save_peft_adapter",), lambda v: v["peft_method"] != "none"),
    )

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
    warmup_ratio: float | None = field(
        default=None,
        metadata={
            "help": "Warm up over this share of the steps (the seed's flag; = --warmup_steps < 1).",
            "ge": 0, "lt": 1, "bound_hint": "e.g. 0.05 warms up over 5%",
        },
    )  # fmt: skip

    def build_callbacks(self, *, peft: bool, fp16: bool) -> list[Any]:
        """The hf_llmkit callbacks these flags switch on (the loss scale exists only in fp16 runs)."""
        from hf_llmkit.callbacks import FaultToleranceCallback, LossScaleCallback, SavePeftModelCallback

        callbacks: list[Any] = [FaultToleranceCallback()] if self.fault_tolerance else []
        if self.save_peft_adapter and peft:
            callbacks.append(SavePeftModelCallback())
        if self.log_loss_scale and fp16:
            callbacks.append(LossScaleCallback())
        return callbacks


def resolve_block_size(data_args: DataArguments, config: Any) -> int:
    """`--block_size`, or min(128, the model's context); larger than the context raises `ValueError`."""
    context = context_length(config)
    if data_args.block_size is None:
        return min(128, context or 128)
    if context is not None and data_args.block_size > context:
        raise ValueError(
            f"--block_size {data_args.block_size} is larger than the model's context ({context} positions); "
            f"pass --block_size {context} or less"
        )
    return data_args.block_size
