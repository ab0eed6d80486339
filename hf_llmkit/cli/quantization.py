"""Quantized training flags: `--quantization dkm` with every `DKMConfig` field as `--dkm_<field>`, and the seed
recipe's `--load_in_kbits {4,8,16}` (a frozen bitsandbytes base under a PEFT adapter, QLoRA-style).

`DKMArguments` is derived from `hf_llmkit.DKMConfig`: a field added there is a flag here, with its help and default.

    >>> config = dkm_args.build_config() or kbit_args.build_config(compute_dtype=torch.float32)
    >>> model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from hf_llmkit.cli.checks import at_most
from hf_llmkit.cli.feature_flags import FlagGroup
from hf_llmkit.cli.options import Option, arguments_class, build_from, config_options
from hf_llmkit.quantization.config import DKMConfig

__all__ = ["DKMArguments", "KbitArguments"]

DKM_OPTIONS = config_options(DKMConfig, prefix="dkm_", skip=("quant_method",))
_SWITCH = Option(
    flag="quantization", field="quantization", type=str | None, default=None, choices=("dkm",),
    help="'dkm': DKM / eDKM train-time weight clustering (hf_llmkit.DKMConfig); the saved model holds packed n-bit "
    "indices and lookup tables.",
)  # fmt: skip


def _post_init(self) -> None:
    # The run's one DKMConfig, built here: it checks its own values before any work (bad values raise ValueError
    # naming the flags), and the model is loaded or quantized with this same object.
    self.dkm_config = build_from(DKMConfig, DKM_OPTIONS, vars(self)) if self.quantization == "dkm" else None


def _build_config(self) -> Any | None:
    """The `DKMConfig` of `--quantization dkm` (None without it), built once when the arguments were."""
    return self.dkm_config


def _describe(self) -> str | None:
    """The results table's quantization row, from the run's config (a recipe fills fields the flags left)."""
    config = self.dkm_config
    if config is None:
        return None
    text = f"DKM {config.bits}-bit ({config.granularity})"
    if config.recipe != "dkm":
        text += f", recipe {config.recipe}"
    if getattr(self, "continued_from", None):
        text += f", continued from the compact checkpoint {self.continued_from}"
    return text


def _calibration(self, train_examples: int, *, warn: bool = False) -> dict[str, Any]:
    """`{"dkm_calibration_samples": N, "dkm_recipe": ...}`: the training examples the run calibrates on (clamped to
    the `train_examples` there are, with one warning line when `warn`; the recipe's own 128 included) and the recipe;
    empty without calibration."""
    config = self.dkm_config
    if config is None or not config.calibration_samples:
        return {}
    used = at_most(
        config.calibration_samples, train_examples, flag="--dkm_calibration_samples", what="training examples",
        warn=warn,
    )  # fmt: skip
    return {"dkm_calibration_samples": used, "dkm_recipe": config.recipe}


_GROUPS = (
    FlagGroup("--quantization dkm", tuple(o.flag for o in DKM_OPTIONS), lambda v: v["quantization"] == "dkm"),
    FlagGroup("--dkm_quantize_embeddings true", ("dkm_embedding_bits",), lambda v: v["dkm_quantize_embeddings"]),
)
DKMArguments = arguments_class(
    "DKMArguments",
    [_SWITCH, *DKM_OPTIONS],
    doc="DKM / eDKM weight clustering during training (quantization-aware training), derived from `DKMConfig`.",
    module=__name__,
    namespace={
        "help_group": "DKM quantization",
        "flag_groups": _GROUPS,
        "__post_init__": _post_init,
        "build_config": _build_config,
        "describe": _describe,
        "calibration": _calibration,
    },
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

    def describe(self) -> str | None:
        return f"bitsandbytes {self.load_in_kbits}-bit base" if self.load_in_kbits != 16 else None
