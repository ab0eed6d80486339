"""Command-line arguments that choose and configure a PEFT method (`HfArgumentParser`-ready).

`PeftArguments.build_config()` turns the flags into a peft config, so a training script needs three lines:

    >>> parser = HfArgumentParser((..., PeftArguments, TrainingArguments))
    >>> config = peft_args.build_config()
    >>> model = get_peft_model(model, config) if config is not None else model
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hf_llmkit.cli.feature_flags import FlagGroup

PEFT_METHODS = ("none", "lora", "bottleneck", "bitfit", "ptuning", "ptuning_v2")


def _method_is(*methods: str) -> Callable[[dict[str, Any]], bool]:
    return lambda values: values["peft_method"] in methods


def _split_commas(names: list[str] | None) -> list[str] | None:
    """`["q_proj,v_proj", "o_proj"]` -> `["q_proj", "v_proj", "o_proj"]` (the seed recipe's comma form)."""
    if names is None:
        return None
    return [part.strip() for name in names for part in name.split(",") if part.strip()]


@dataclass
class PeftArguments:
    """Which PEFT method to train with, and its options (the seed recipe's `--lora_rank`, `--modules_to_save`...).

    Args:
        peft_method: "none" (train all weights), "lora" (peft), "bottleneck", "bitfit", "ptuning" or
            "ptuning_v2" (hf_llmkit).
        target_modules: Modules to adapt (name suffixes; space- or comma-separated, the seed's `--trainable
            q_proj,v_proj`); default: each method's default for the model family.
        modules_to_save: Modules trained in full and saved with the adapter (`embed_tokens,lm_head`). With tied
            input/output embeddings, LoRA keeps them tied (`ensure_weight_tying`); the other methods train the two
            as separate copies.
        lora_rank, lora_alpha, lora_dropout: LoRA's rank, scaling numerator and dropout.
        bottleneck_placement: houlsby, pfeiffer or parallel.
        bottleneck_size / bottleneck_reduction_factor: bottleneck width, or hidden size / factor (default 16).
        bottleneck_non_linearity, bottleneck_dropout, bottleneck_scaling: the adapter's activation, input
            dropout and output scale (default 1, or 4 for parallel).
        bitfit_add_missing_biases: give bias-less Linear layers (Llama) a trainable zero-initialised bias.
        num_virtual_tokens: P-tuning v1 virtual tokens / P-tuning v2 prefix length per layer.
        ptuning_template: P-tuning v1 template around each text block (default: all virtual tokens first).
        ptuning_encoder, ptuning_encoder_hidden_size: P-tuning v1 prompt encoder (MLP or LSTM) and its width (also
            the width of P-tuning v2's projection MLP).
        prefix_projection: P-tuning v2: reparameterise the prefixes by an MLP while training.
    """

    help_group: ClassVar[str] = "PEFT"
    flag_groups: ClassVar[tuple[FlagGroup, ...]] = (
        FlagGroup("--peft_method lora", ("lora_rank", "lora_alpha", "lora_dropout"), _method_is("lora")),
        FlagGroup(
            "--peft_method bottleneck",
            (
                "bottleneck_placement",
                "bottleneck_size",
                "bottleneck_reduction_factor",
                "bottleneck_non_linearity",
                "bottleneck_dropout",
                "bottleneck_scaling",
            ),
            _method_is("bottleneck"),
        ),  # fmt: skip
        FlagGroup("--peft_method bitfit", ("bitfit_add_missing_biases",), _method_is("bitfit")),
        FlagGroup("--peft_method ptuning or ptuning_v2", ("num_virtual_tokens",), _method_is("ptuning", "ptuning_v2")),
        FlagGroup("--peft_method ptuning", ("ptuning_template", "ptuning_encoder"), _method_is("ptuning")),
        FlagGroup("--peft_method ptuning_v2", ("prefix_projection",), _method_is("ptuning_v2")),
        FlagGroup(
            "--peft_method ptuning (or ptuning_v2 --prefix_projection true)",
            ("ptuning_encoder_hidden_size",),
            lambda v: v["peft_method"] == "ptuning" or (v["peft_method"] == "ptuning_v2" and v["prefix_projection"]),
        ),
        FlagGroup(
            "a --peft_method (e.g. --peft_method lora)",
            ("target_modules", "modules_to_save"),
            lambda v: v["peft_method"] != "none",
        ),
    )

    peft_method: str = field(
        default="none", metadata={"help": "PEFT method ('none' trains all weights).", "choices": list(PEFT_METHODS)}
    )
    target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Modules to adapt (name suffixes, e.g. q_proj,v_proj); default: the method's per-model default.",
            "aliases": ["--trainable"],
        },
    )
    modules_to_save: list[str] | None = field(
        default=None,
        metadata={"help": "Modules trained in full and saved with the adapter (e.g. embed_tokens,lm_head)."},
    )
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling numerator (scale = alpha / rank)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on LoRA's input."})
    bottleneck_placement: str = field(
        default="houlsby",
        metadata={"help": "Bottleneck adapter placement.", "choices": ["houlsby", "pfeiffer", "parallel"]},
    )
    bottleneck_size: int | None = field(default=None, metadata={"help": "Bottleneck width."})
    bottleneck_reduction_factor: float | None = field(
        default=None, metadata={"help": "Bottleneck width = hidden size / factor (default 16)."}
    )
    bottleneck_non_linearity: str = field(default="relu", metadata={"help": "Bottleneck activation (ACT2FN name)."})
    bottleneck_dropout: float = field(default=0.0, metadata={"help": "Dropout on the adapter input."})
    bottleneck_scaling: float | None = field(
        default=None, metadata={"help": "Adapter output scale (default 1, 4 for parallel)."}
    )
    bitfit_add_missing_biases: bool = field(
        default=True, metadata={"help": "BitFit: add trainable zero biases to bias-less Linear layers (Llama)."}
    )
    num_virtual_tokens: int = field(
        default=20, metadata={"help": "P-tuning v1 virtual tokens / P-tuning v2 prefix length per layer."}
    )
    ptuning_template: str | None = field(
        default=None, metadata={"help": "P-tuning v1 template, e.g. '[P0][P1] {text} [P2]' (default: tokens first)."}
    )
    ptuning_encoder: str = field(
        default="MLP", metadata={"help": "P-tuning v1 prompt encoder.", "choices": ["MLP", "LSTM"]}
    )
    ptuning_encoder_hidden_size: int | None = field(
        default=None, metadata={"help": "P-tuning v1 encoder / v2 projection width (default: hidden size)."}
    )
    prefix_projection: bool = field(
        default=False, metadata={"help": "P-tuning v2: reparameterise the prefixes by an MLP while training."}
    )

    def __post_init__(self) -> None:
        self.target_modules = _split_commas(self.target_modules)
        self.modules_to_save = _split_commas(self.modules_to_save)
        if self.peft_method not in PEFT_METHODS:
            raise ValueError(f"--peft_method {self.peft_method!r} is unknown; use one of {', '.join(PEFT_METHODS)}")
        if self.peft_method == "none" and (self.target_modules or self.modules_to_save):
            raise ValueError("--target_modules / --modules_to_save need a --peft_method (e.g. --peft_method lora)")
        if self.bottleneck_size is not None and self.bottleneck_reduction_factor is not None:
            raise ValueError("pass either --bottleneck_size or --bottleneck_reduction_factor, not both")

    def build_config(self, *, tied_embeddings: bool = False) -> Any | None:
        """The peft config for the chosen method (None for full fine-tuning); configs validate their own fields.

        `tied_embeddings`: the model ties its input and output embeddings (`tie_word_embeddings`); LoRA then keeps
        an embedding listed in `modules_to_save` tied to the output layer (`ensure_weight_tying`).
        """
        if self.peft_method == "lora":
            return _lora(self, ensure_weight_tying=tied_embeddings and bool(self.modules_to_save))
        return _BUILDERS[self.peft_method](self)


def _common(args: PeftArguments) -> dict[str, Any]:
    return {"target_modules": args.target_modules, "modules_to_save": args.modules_to_save}


def _lora(args: PeftArguments, *, ensure_weight_tying: bool = False):
    from peft import LoraConfig

    return LoraConfig(
        task_type="CAUSAL_LM", r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        ensure_weight_tying=ensure_weight_tying, **_common(args),
    )  # fmt: skip


def _bottleneck(args: PeftArguments):
    from hf_llmkit.tuners.bottleneck import BottleneckConfig

    return BottleneckConfig(
        task_type="CAUSAL_LM",
        placement=args.bottleneck_placement,
        bottleneck_size=args.bottleneck_size,
        reduction_factor=args.bottleneck_reduction_factor,
        non_linearity=args.bottleneck_non_linearity,
        dropout=args.bottleneck_dropout,
        scaling=args.bottleneck_scaling,
        **_common(args),
    )


def _bitfit(args: PeftArguments):
    from hf_llmkit.tuners.bitfit import BitFitConfig

    return BitFitConfig(task_type="CAUSAL_LM", add_missing_biases=args.bitfit_add_missing_biases, **_common(args))


def _ptuning(args: PeftArguments):
    from hf_llmkit.tuners.ptuning import PTuningConfig

    return PTuningConfig(
        task_type="CAUSAL_LM",
        num_virtual_tokens=args.num_virtual_tokens,
        template=args.ptuning_template,
        encoder_reparameterization_type=args.ptuning_encoder,
        encoder_hidden_size=args.ptuning_encoder_hidden_size,
        **_common(args),
    )


def _ptuning_v2(args: PeftArguments):
    from hf_llmkit.tuners.ptuning_v2 import PTuningV2Config

    return PTuningV2Config(
        task_type="CAUSAL_LM",
        num_virtual_tokens=args.num_virtual_tokens,
        prefix_projection=args.prefix_projection,
        encoder_hidden_size=args.ptuning_encoder_hidden_size if args.prefix_projection else None,
        **_common(args),
    )


# peft_method -> config builder; a method added to PEFT_METHODS adds its builder here.
_BUILDERS: dict[str, Callable[[PeftArguments], Any]] = {
    "none": lambda args: None,
    "lora": _lora,
    "bottleneck": _bottleneck,
    "bitfit": _bitfit,
    "ptuning": _ptuning,
    "ptuning_v2": _ptuning_v2,
}
