"""Command-line arguments for quantized training (`HfArgumentParser`-ready).

- `DKMArguments`: `--quantization dkm` and the `--dkm_*` flags -> a `DKMConfig` (train-time weight clustering).
- `KbitArguments`: the seed recipe's `--load_in_kbits {4,8,16}` -> a bitsandbytes config (a frozen 4/8-bit base
  under a PEFT adapter, QLoRA-style).

A training script needs three lines:

    >>> parser = HfArgumentParser((..., DKMArguments, KbitArguments, TrainingArguments))
    >>> config = dkm_args.build_config() or kbit_args.build_config(compute_dtype=torch.float32)
    >>> model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from hf_llmkit.cli.feature_flags import FlagGroup

__all__ = ["DKMArguments", "KbitArguments"]

_DKM_FLAGS = (
    "dkm_bits",
    "dkm_cluster_dim",
    "dkm_granularity",
    "dkm_group_size",
    "dkm_embedding_bits",
    "dkm_temperature",
    "dkm_shard",
)


@dataclass
class DKMArguments:
    """DKM / eDKM weight clustering during training (quantization-aware training).

    Args:
        quantization: "dkm" trains with DKM / eDKM weight clustering (`hf_llmkit.DKMConfig`); the saved model
            holds packed n-bit indices + lookup tables. Use `--torch_dtype bfloat16` for eDKM's unique-value table
            (32-bit weights fall back to naive DKM's memory).
        dkm_bits, dkm_cluster_dim, dkm_granularity, dkm_group_size, dkm_temperature, dkm_shard: the matching
            `DKMConfig` fields (`bits`, `cluster_dim`, ...).
        dkm_embedding_bits: also cluster the embeddings, at these bits (`quantize_embeddings` + `embedding_bits`).
    """

    help_group: ClassVar[str] = "DKM quantization"
    flag_groups: ClassVar[tuple[FlagGroup, ...]] = (
        FlagGroup(switch="--quantization dkm", flags=_DKM_FLAGS, is_on=lambda a: a["quantization"] == "dkm"),
    )

    quantization: str | None = field(
        default=None, metadata={"help": "'dkm': DKM/eDKM train-time weight clustering.", "choices": ["dkm"]}
    )
    dkm_bits: int = field(default=3, metadata={"help": "Bits per index (1-8)."})
    dkm_cluster_dim: int = field(default=1, metadata={"help": "Weights per clustered vector."})
    dkm_granularity: str = field(
        default="per_tensor",
        metadata={
            "help": "One table per tensor, or per --dkm_group_size output channels.",
            "choices": ["per_tensor", "per_grouped_channel"],
        },
    )
    dkm_group_size: int = field(default=32, metadata={"help": "Output channels per table (per_grouped_channel)."})
    dkm_embedding_bits: int | None = field(
        default=None, metadata={"help": "Also cluster the embeddings, at these bits (default: embeddings stay)."}
    )
    dkm_temperature: float = field(default=0.02, metadata={"help": "Soft-assignment temperature (x weight std)."})
    dkm_shard: bool = field(default=False, metadata={"help": "eDKM: shard the unique-value table across the ranks."})

    def build_config(self) -> Any | None:
        """The `DKMConfig` of `--quantization dkm` (None without it); bad values raise ValueError naming the fix."""
        if self.quantization != "dkm":
            return None
        from hf_llmkit.quantization.config import DKMConfig

        return DKMConfig(
            bits=self.dkm_bits,
            cluster_dim=self.dkm_cluster_dim,
            granularity=self.dkm_granularity,
            group_size=self.dkm_group_size,
            quantize_embeddings=self.dkm_embedding_bits is not None,
            embedding_bits=self.dkm_embedding_bits or 8,
            temperature=self.dkm_temperature,
            shard=self.dkm_shard,
        )


@dataclass
class KbitArguments:
    """Loading the base model in 4 or 8 bits with bitsandbytes, as the seed recipe's `--load_in_kbits`.

    Args:
        load_in_kbits: 16 (default) loads the weights in `--torch_dtype`; 8 (LLM.int8) or 4 (NF4 with double
            quantization) load the Linear weights quantized and frozen, for training a PEFT adapter on top.
            `modules_to_save` (e.g. embed_tokens, lm_head) stay unquantized.
    """

    help_group: ClassVar[str] = "quantization"

    load_in_kbits: int = field(
        default=16,
        metadata={
            "help": "Load the base weights in 4 or 8 bits (bitsandbytes; needs --peft_method).",
            "choices": [4, 8, 16],
        },
    )

    def build_config(self, *, compute_dtype: Any, skip_modules: list[str] | None = None) -> Any | None:
        """A `BitsAndBytesConfig` for 4 or 8 bits (None for 16); `skip_modules` stay unquantized."""
        if self.load_in_kbits == 16:
            return None
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=self.load_in_kbits == 4,
            load_in_8bit=self.load_in_kbits == 8,
            llm_int8_threshold=6.0,
            llm_int8_skip_modules=list(skip_modules) if skip_modules else None,
            bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_use_double_quant=True,
            bnb_4bit_quant_type="nf4",
        )
