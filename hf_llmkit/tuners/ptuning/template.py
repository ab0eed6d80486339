"""Templates for P-tuning v1: build them, add their virtual tokens to a tokenizer, and fill them with text.

A template is a format string with virtual tokens `[P0]..[P{n-1}]` and named fields, e.g.
`"[P0][P1][P2] {text} [P3]"`. `PTuningTemplate(tokenizer, config)` adds the virtual tokens to the tokenizer as special
tokens (so text never splits into them) and records the id of `[P0]` in the config; the adapter's embedding wrapper
embeds exactly those ids with its prompt encoder.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_llmkit.tuners.ptuning.config import VIRTUAL_TOKEN_FORMAT, PTuningConfig, check_template, template_fields


def build_ptuning_template(*parts: int | str) -> str:
    """Concatenate runs of virtual tokens (ints: how many) and literal text (strs), numbering tokens in order.

    `build_ptuning_template(3, " {text} ", 1)` returns `"[P0][P1][P2] {text} [P3]"`.
    """
    out, k = [], 0
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, (int, str)):
            raise ValueError(f"template parts are ints (virtual token counts) or strs (text), got {part!r}")
        if isinstance(part, int):
            if part < 0:
                raise ValueError(f"a virtual token count must be >= 0, got {part}")
            out.extend(VIRTUAL_TOKEN_FORMAT.format(k + i) for i in range(part))
            k += part
        else:
            out.append(part)
    template = "".join(out)
    check_template(template, k)
    return template


class PTuningTemplate:
    """A P-tuning template bound to a tokenizer: adds the virtual tokens and turns fields into model inputs.

    Args:
        tokenizer: A `transformers` tokenizer; the virtual tokens are added to it (idempotently).
        config: The adapter's `PTuningConfig`. Its `virtual_token_start_id` is set to the id of the first virtual
            token, or checked against it when already set (e.g. a reloaded adapter).
        namespace: Distinguishes the virtual tokens of several adapters on one model: `"task2"` gives tokens
            `[task2:P0]...` (and their own ids) while templates keep writing `[P0]`.
    """

    def __init__(self, tokenizer: Any, config: PTuningConfig, *, namespace: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.template = config.template
        n = config.num_virtual_tokens
        self.tokens = [self._token(k, namespace) for k in range(n)]
        tokenizer.add_tokens(self.tokens, special_tokens=True)
        ids = tokenizer.convert_tokens_to_ids(self.tokens)
        if ids != list(range(ids[0], ids[0] + n)):
            raise ValueError(
                f"the tokenizer gave the virtual tokens non-contiguous ids {ids}; some of {self.tokens} were already "
                "in its vocabulary. Use a fresh tokenizer or another namespace="
            )
        if config.virtual_token_start_id is None:
            config.virtual_token_start_id = ids[0]
        elif config.virtual_token_start_id != ids[0]:
            raise ValueError(
                f"the adapter expects [P0] at id {config.virtual_token_start_id} but this tokenizer puts it at "
                f"{ids[0]}; load the tokenizer saved with the adapter, or create the PTuningTemplate before "
                "get_peft_model so the config takes the tokenizer's ids"
            )
        self.virtual_token_ids = ids

    @staticmethod
    def _token(k: int, namespace: str | None) -> str:
        return VIRTUAL_TOKEN_FORMAT.format(k) if namespace is None else f"[{namespace}:P{k}]"

    @property
    def fields(self) -> list[str]:
        return template_fields(self.template)

    def format(self, **fields: str) -> str:
        """The template with its fields filled in and the virtual tokens in this tokenizer's spelling."""
        missing = [f for f in self.fields if f not in fields]
        if missing:
            raise ValueError(f"template {self.template!r} needs the fields {missing}; pass them as keyword arguments")
        text = self.template.format(**fields)
        for k in reversed(range(len(self.tokens))):  # reversed: replace [P10] before [P1]
            text = text.replace(VIRTUAL_TOKEN_FORMAT.format(k), self.tokens[k])
        return text

    def is_virtual(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Boolean mask of the virtual token positions in `input_ids`."""
        start = self.virtual_token_ids[0]
        return (input_ids >= start) & (input_ids < start + len(self.tokens))

    def mask_labels(self, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """`labels` with the virtual tokens set to `ignore_index` (the model never predicts them)."""
        return labels.masked_fill(self.is_virtual(labels), ignore_index)

    def wrap_ids(self, ids: list[int], *, max_length: int | None = None) -> dict[str, list[int]]:
        """Place already-tokenized text into a single-field template (e.g. fixed-size LM blocks).

        Literal template text is tokenized without special tokens; with `max_length` the text is cut so the result
        has exactly that length (`ids` must be long enough). Returns `input_ids` and `labels` (-100 on virtual ids).
        """
        if len(self.fields) != 1:
            raise ValueError(f"wrap_ids needs a template with one field, {self.template!r} has {self.fields}")
        before, after = self.format(**{self.fields[0]: "\0"}).split("\0")
        head, tail = self._encode_literal(before), self._encode_literal(after)
        if max_length is not None:
            room = max_length - len(head) - len(tail)
            if room < 1 or len(ids) < room:
                raise ValueError(
                    f"max_length={max_length} leaves {room} text tokens after the template's {len(head) + len(tail)} "
                    f"and {len(ids)} were given; raise max_length (block size) or shorten the template"
                )
            ids = list(ids[:room])
        input_ids = head + list(ids) + tail
        start, end = self.virtual_token_ids[0], self.virtual_token_ids[0] + len(self.tokens)
        return {"input_ids": input_ids, "labels": [-100 if start <= i < end else i for i in input_ids]}

    def wrap_blocks(self, dataset: Any) -> Any:
        """A `datasets.Dataset` of LM blocks (`input_ids`) with the template applied to each, lengths unchanged."""
        return dataset.map(
            lambda row: self.wrap_ids(row["input_ids"], max_length=len(row["input_ids"])), desc="P-tuning template"
        )

    def _encode_literal(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def __call__(self, **fields: Any) -> dict[str, Any]:
        """Tokenize one filled template; adds `labels` (input ids with virtual tokens ignored) for causal LM training.

        Keyword arguments that are not template fields go to the tokenizer (e.g. `return_tensors="pt"`).
        """
        names = set(self.fields)
        text = self.format(**{k: v for k, v in fields.items() if k in names})
        encoded = self.tokenizer(text, **{k: v for k, v in fields.items() if k not in names})
        ids = encoded["input_ids"]
        if isinstance(ids, torch.Tensor):
            encoded["labels"] = self.mask_labels(ids.clone())
        else:
            start, end = self.virtual_token_ids[0], self.virtual_token_ids[0] + len(self.tokens)
            encoded["labels"] = [-100 if start <= i < end else i for i in ids]
        return encoded
