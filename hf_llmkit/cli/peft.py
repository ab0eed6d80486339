"""`PeftArguments`: `--peft_method` and every option of every PEFT method, derived from the methods' configs.

The methods are `hf_llmkit.tuners.PEFT_METHODS` (peft's LoRA and hf_llmkit's own). Each config field of a
command-line type is a flag `--<method>_<field>` with the field's help and default (`--bottleneck_placement`,
`--bitfit_add_missing_biases`, `--ptuning_v2_prefix_projection`); a field already starting with the method's name
keeps it (`--bottleneck_size`, `--lora_alpha`). Within the chosen method the prefix may be left out
(`--peft_method ptuning_v2 --num_virtual_tokens 16`). The module-selection fields every method shares
(`--target_modules`, alias the seed recipe's `--trainable`, `--modules_to_save`, `--exclude_modules`,
`--layers_to_transform`, `--layers_pattern`) are one flag each, passed to the configs that have the field.

    >>> parser = CommandLineParser([..., PeftArguments, TrainingArguments])
    >>> config = peft_args.build_config()            # the chosen method's peft config, or None for "none"
    >>> model = get_peft_model(model, config) if config is not None else model
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from peft import PeftConfig

from hf_llmkit.cli.feature_flags import FlagGroup
from hf_llmkit.cli.options import Option, arguments_class, config_options, flag_names
from hf_llmkit.tuners import PEFT_METHODS, PeftMethod

__all__ = ["PeftArguments", "peft_arguments"]

# Selection fields shared by the methods: one flag each, given to every config that declares the field.
SHARED = ("target_modules", "modules_to_save", "exclude_modules", "layers_to_transform", "layers_pattern")
_LISTS_WITH_COMMAS = ("target_modules", "modules_to_save")  # the seed recipe's `--trainable q_proj,v_proj`
# Config fields that are not options: peft's bookkeeping, values the command derives from the model or the
# tokenizer (or peft from the layer type), random initialisations for tests, and LoRA variants for other stacks
# (GPTQ's QALoRA, aLoRA's invocation token ids, Megatron).
NOT_OPTIONS = {f.name for f in dataclasses.fields(PeftConfig)} | {
    "virtual_token_start_id", "token_dim", "ensure_weight_tying", "fan_in_fan_out", "init_weights",
    "megatron_core", "use_qalora", "qalora_group_size", "alora_invocation_tokens",
}  # fmt: skip
# Spellings of the seed recipe and of earlier versions of this command (`--lora_rank` is peft's `r`).
FLAG_NAMES = {"lora": {"r": "rank", "bias": "bias_type"}, "ptuning": {"encoder_reparameterization_type": "encoder"}}
# The main job's defaults where they differ from the config's: the seed recipe's LoRA, BitFit on bias-less Llama
# layers, and the prompt length the P-tuning papers use.
RECIPE_DEFAULTS = {
    "lora_alpha": 16, "lora_dropout": 0.05, "bitfit_add_missing_biases": True, "ptuning_num_virtual_tokens": 20,
}  # fmt: skip
# peft's LoraConfig accepts any number; these are the values that make sense (checked before any work).
HOST_BOUNDS = {"lora_rank": {"ge": 1}, "lora_alpha": {"gt": 0}, "lora_dropout": {"ge": 0, "lt": 1}}
# Methods whose adapter is a linear change of base weights and biases: `merge_and_unload` folds it in exactly.
MERGEABLE = ("lora", "bitfit")
MERGE_ADAPTER = Option(
    flag="merge_adapter", field="merge_adapter", type=bool, default=False,
    help="After training, also save the model with the adapter merged into its weights, a plain model any "
    "from_pretrained loads, to output_dir/merged (LoRA, BitFit).",
)  # fmt: skip


def _method_options(method: PeftMethod) -> list[Option]:
    """The flags of one PEFT method (without the shared selection flags)."""
    name = method.name
    options = config_options(
        method.config_cls, prefix=f"{name}_", skip=(*NOT_OPTIONS, *SHARED), rename=FLAG_NAMES.get(name)
    )
    return [
        dataclasses.replace(
            o, default=RECIPE_DEFAULTS.get(o.flag, o.default), bounds=HOST_BOUNDS.get(o.flag, o.bounds)
        )
        for o in options
    ]


def _shared_options(methods: Mapping[str, PeftMethod]) -> list[Option]:
    declared = {}
    for method in reversed(methods.values()):  # hf_llmkit's declarations first (peft's helps name LoRA)
        for option in config_options(method.config_cls, prefix="", skip=NOT_OPTIONS):
            if option.field in SHARED:
                declared.setdefault(option.field, option)
    help_texts = {
        "target_modules": "Modules to adapt (name suffixes, space- or comma-separated, e.g. q_proj,v_proj); "
        "default: the method's default for the model family.",
        "modules_to_save": "Modules trained in full and saved with the adapter (e.g. embed_tokens,lm_head).",
    }
    options = []
    for name in SHARED:
        option = declared[name]
        if name in _LISTS_WITH_COMMAS:  # one flag form for every method: names, commas allowed
            option = dataclasses.replace(option, type=list[str] | None, help=help_texts[name])
        if name == "target_modules":
            option = dataclasses.replace(option, aliases=("--trainable",))
        options.append(option.with_default(None))
    return options


def _split_commas(names: list[str] | None) -> list[str] | None:
    """`["q_proj,v_proj", "o_proj"]` -> `["q_proj", "v_proj", "o_proj"]` (the seed recipe's comma form)."""
    if names is None:
        return None
    return [part.strip() for name in names for part in name.split(",") if part.strip()]


class _PeftMethods:
    """The methods of a `PeftArguments` class (see `peft_arguments`); `self` is an instance of that class."""

    methods: Mapping[str, PeftMethod]
    method_options: Mapping[str, list[Option]]
    shared_options: list[Option]
    help_group = "PEFT"

    @classmethod
    def flag_spellings(cls, argv: Sequence[str], known: set[str]) -> dict[str, str]:
        """For the `--peft_method` in `argv`: its flags without the method's prefix, `{"--num_virtual_tokens":
        "--ptuning_v2_num_virtual_tokens"}` (a spelling that is a flag of its own keeps its meaning)."""
        method = None
        for index, token in enumerate(argv):
            if token == "--peft_method" and index + 1 < len(argv):
                method = argv[index + 1]
            elif token.startswith("--peft_method="):
                method = token.split("=", 1)[1]
        spellings = {}
        for option in cls.method_options.get(method, ()):
            short = option.flag[len(method) + 1 :] if option.flag.startswith(f"{method}_") else None
            if short and f"--{short}" not in known:
                spellings[f"--{short}"] = f"--{option.flag}"
        return spellings

    @classmethod
    def unknown_flag_hint(cls, flag: str) -> str | None:
        """For a method's flag written without its prefix while that method is not chosen: which methods have it."""
        owners = [n for n, options in cls.method_options.items() if any(o.flag == f"{n}_{flag[2:]}" for o in options)]
        if not owners:
            return None
        methods = " or ".join(owners)
        return f"{flag} is an option of --peft_method {methods}; add --peft_method {owners[0]} or drop {flag}"

    def __post_init__(self) -> None:
        for name in _LISTS_WITH_COMMAS:
            setattr(self, name, _split_commas(getattr(self, name)))
        if self.peft_method == "none":
            for option in self.shared_options:
                if getattr(self, option.flag) is not None:
                    raise ValueError(f"--{option.flag} needs a --peft_method (e.g. --peft_method lora)")
            return
        if self.merge_adapter and self.peft_method not in MERGEABLE:
            raise ValueError(
                f"--merge_adapter folds the adapter into the weights; a {self.peft_method} adapter is not a change "
                f"of weights to fold: use --peft_method {' or '.join(MERGEABLE)}, or drop --merge_adapter"
            )
        config_fields = {f.name for f in dataclasses.fields(self.methods[self.peft_method].config_cls)}
        for option in self.shared_options:
            if getattr(self, option.flag) is not None and option.field not in config_fields:
                raise ValueError(f"--{option.flag} has no effect with --peft_method {self.peft_method}; drop it")
        self.build_config()  # the method's own checks, before any work

    def build_config(self, *, tied_embeddings: bool = False) -> Any | None:
        """The peft config of the chosen method (None for "none"); the config checks its own values.

        `tied_embeddings`: the model ties its input and output embeddings; an embedding listed in
        `modules_to_save` then stays tied to the output layer (`ensure_weight_tying`, where the config has it)."""
        if self.peft_method == "none":
            return None
        method = self.methods[self.peft_method]
        kwargs = {o.field: getattr(self, o.flag) for o in self.method_options[self.peft_method]}
        config_fields = {f.name for f in dataclasses.fields(method.config_cls)}
        kwargs.update({o.field: getattr(self, o.flag) for o in self.shared_options if o.field in config_fields})
        if "ensure_weight_tying" in config_fields:
            kwargs["ensure_weight_tying"] = tied_embeddings and bool(self.modules_to_save)
        try:
            return method.config_cls(task_type="CAUSAL_LM", **kwargs)
        except ValueError as err:  # the config's message, with its fields written as this command's flags
            options = [*self.method_options[self.peft_method], *self.shared_options]
            raise ValueError(flag_names(str(err), method.config_cls, options)) from err

    def describe(self) -> str:
        """The method as a results table names it ("LoRA (rank 8, alpha 16)", "full fine-tuning")."""
        if self.peft_method == "none":
            return "full fine-tuning"
        return self.methods[self.peft_method].describe(self.build_config())


def peft_arguments(methods: Mapping[str, PeftMethod] = PEFT_METHODS) -> type:
    """The `PeftArguments` dataclass of `methods` (default: every registered method): `--peft_method`, the shared
    selection flags, and each method's flags with its feature-flag group."""
    method_options = {name: _method_options(method) for name, method in methods.items()}
    shared = _shared_options(methods)
    groups = [
        FlagGroup(f"--peft_method {name}", tuple(o.flag for o in options), lambda v, n=name: v["peft_method"] == n)
        for name, options in method_options.items()
    ]
    groups.append(
        FlagGroup(
            "a --peft_method (e.g. --peft_method lora)", (*(o.flag for o in shared), MERGE_ADAPTER.flag),
            lambda v: v["peft_method"] != "none",
        )
    )  # fmt: skip
    choice = Option(
        flag="peft_method", field="peft_method", type=str, default="none", choices=("none", *methods),
        help="PEFT method ('none' trains all weights); a method's flags start with its name.",
    )  # fmt: skip
    return arguments_class(
        "PeftArguments",
        [choice, MERGE_ADAPTER, *shared, *(o for options in method_options.values() for o in options)],
        doc="Which PEFT method to train with, and its options (derived from `hf_llmkit.tuners.PEFT_METHODS`).",
        module=__name__,
        namespace={
            **{k: v for k, v in vars(_PeftMethods).items() if not k.startswith("__") or k == "__post_init__"},
            "methods": dict(methods),
            "method_options": method_options,
            "shared_options": shared,
            "flag_groups": tuple(groups),
        },
    )


PeftArguments = peft_arguments()
