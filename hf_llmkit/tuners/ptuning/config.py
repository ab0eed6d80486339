"""Configuration of P-tuning v1 ("GPT Understands, Too", Liu et al. 2021) as a layer-injecting peft method."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import Literal, Union

from hf_llmkit.tuners.base import SavedModulesConfig
from hf_llmkit.tuners.registration import LLMKitPeftType

VIRTUAL_TOKEN_FORMAT = "[P{}]"
_VIRTUAL_TOKEN_RE = re.compile(r"\[P(\d+)\]")


def template_fields(template: str) -> list[str]:
    """The `{field}` placeholders of a template, in order."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def check_template(template: str, num_virtual_tokens: int) -> None:
    """Raise a ValueError naming the fix unless `template` holds each of [P0]..[P{n-1}] once and a `{field}`."""
    found = [int(k) for k in _VIRTUAL_TOKEN_RE.findall(template)]
    expected = list(range(num_virtual_tokens))
    missing = [k for k in expected if k not in found]
    if missing:
        raise ValueError(
            f"template {template!r} does not place the virtual tokens "
            f"{', '.join(VIRTUAL_TOKEN_FORMAT.format(k) for k in missing)}; every one of "
            f"[P0]..[P{num_virtual_tokens - 1}] must appear once (build it with hf_llmkit.build_ptuning_template, "
            "e.g. build_ptuning_template(3, ' {text} ', 1)) or change num_virtual_tokens"
        )
    extra = sorted({k for k in found if k >= num_virtual_tokens})
    if extra:
        raise ValueError(
            f"template {template!r} uses {', '.join(VIRTUAL_TOKEN_FORMAT.format(k) for k in extra)} but "
            f"num_virtual_tokens={num_virtual_tokens}; raise num_virtual_tokens or remove those tokens"
        )
    if len(found) != len(set(found)):
        raise ValueError(f"template {template!r} repeats a virtual token; each [Pk] must appear exactly once")
    try:
        names = template_fields(template)
    except ValueError as err:
        raise ValueError(
            f"template {template!r} is not a valid format string ({err}); escape literal braces as '{{{{'"
        ) from err
    if not names or any(not n for n in names):
        raise ValueError(
            f"template {template!r} needs named placeholders for the input text, e.g. '[P0][P1] {{text}}'"
        )


@dataclass
class PTuningConfig(SavedModulesConfig):
    """Configuration of P-tuning v1: virtual prompt tokens whose embeddings come from a trainable prompt encoder.

    The virtual tokens `[P0]..[P{n-1}]` are ordinary token ids in the input (placed by `template`); the wrapped input
    embedding layer returns the frozen base embedding for normal ids and the prompt encoder's output for virtual ids.
    The whole encoder (its input embeddings and MLP/LSTM) is saved with the adapter, so training resumes exactly.

    Args:
        num_virtual_tokens (`int`): Number of virtual prompt tokens `[P0]..[P{n-1}]` (>= 1).
        template (`str`, *optional*): Where the virtual tokens go around the input, a format string such as
            `"[P0][P1][P2] {text} [P3]"`. Must place every virtual token once. Defaults to all virtual tokens before
            `{text}`.
        virtual_token_start_id (`int`, *optional*): Token id of `[P0]`; `[Pk]` has id `start + k`. `None` means the
            base vocabulary size (ids past the embedding matrix, so no embedding resize is needed); set by
            `PTuningTemplate(tokenizer, config)` to the ids the tokenizer gave the virtual tokens.
        encoder_reparameterization_type (`str`): Prompt encoder, `"MLP"` or `"LSTM"` (bidirectional LSTM + MLP head).
        encoder_hidden_size (`int`, *optional*): Hidden size of the prompt encoder; defaults to the token dimension.
        encoder_num_layers (`int`): Number of LSTM layers (LSTM encoder only).
        encoder_dropout (`float`): Dropout inside the prompt encoder.
        token_dim (`int`, *optional*): Embedding size of the base model; filled in from the embedding layer.
        target_modules (`str` or `list[str]`, *optional*): The input embedding module to wrap; defaults to the model's
            `get_input_embeddings()` module.

    `modules_to_save` and `ensure_weight_tying` as in `SavedModulesConfig`, except for the input embedding itself:
    P-tuning wraps it, so it cannot be trained in full as well.
    """

    num_virtual_tokens: int = field(default=10, metadata={"help": "Number of virtual prompt tokens [P0]..[P{n-1}]."})
    template: str | None = field(
        default=None,
        metadata={
            "help": "Format string placing the virtual tokens around the input, e.g. '[P0][P1][P2] {text} [P3]'; "
            "defaults to all virtual tokens before '{text}'."
        },
    )
    virtual_token_start_id: int | None = field(
        default=None,
        metadata={
            "help": "Token id of [P0] ([Pk] = start + k); None = the base vocabulary size. Set by PTuningTemplate."
        },
    )
    encoder_reparameterization_type: Literal["MLP", "LSTM"] = field(
        default="MLP", metadata={"help": "Prompt encoder: 'MLP' or 'LSTM' (bidirectional LSTM + MLP head)."}
    )
    encoder_hidden_size: int | None = field(
        default=None, metadata={"help": "Hidden size of the prompt encoder; defaults to the token dimension."}
    )
    encoder_num_layers: int = field(default=2, metadata={"help": "Number of LSTM layers (LSTM encoder only)."})
    encoder_dropout: float = field(default=0.0, metadata={"help": "Dropout inside the prompt encoder."})
    token_dim: int | None = field(
        default=None, metadata={"help": "Embedding size of the base model; filled in from the embedding layer."}
    )
    target_modules: Union[list[str], str] | None = field(
        default=None,
        metadata={"help": "The input embedding module to wrap; defaults to the model's get_input_embeddings()."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = LLMKitPeftType.PTUNING
        if not isinstance(self.num_virtual_tokens, int) or self.num_virtual_tokens < 1:
            raise ValueError(f"num_virtual_tokens must be an int >= 1, got {self.num_virtual_tokens!r}")
        if self.template is None:
            self.template = "".join(VIRTUAL_TOKEN_FORMAT.format(k) for k in range(self.num_virtual_tokens)) + "{text}"
        check_template(self.template, self.num_virtual_tokens)
        if self.virtual_token_start_id is not None and self.virtual_token_start_id < 0:
            raise ValueError(f"virtual_token_start_id must be >= 0 (or None), got {self.virtual_token_start_id}")
        kind = str(self.encoder_reparameterization_type).upper()
        if kind not in ("MLP", "LSTM"):
            raise ValueError(
                "encoder_reparameterization_type must be 'MLP' or 'LSTM', got "
                f"{self.encoder_reparameterization_type!r}"
            )
        self.encoder_reparameterization_type = kind
        if self.encoder_hidden_size is not None and self.encoder_hidden_size < 1:
            raise ValueError(f"encoder_hidden_size must be >= 1 (or None), got {self.encoder_hidden_size}")
        if self.encoder_num_layers < 1:
            raise ValueError(f"encoder_num_layers must be >= 1, got {self.encoder_num_layers}")
        if not 0.0 <= self.encoder_dropout < 1.0:
            raise ValueError(f"encoder_dropout must be in [0, 1), got {self.encoder_dropout}")
        if isinstance(self.target_modules, list):
            self.target_modules = set(self.target_modules)
