"""Instruction data for supervised fine-tuning: records, prompt templates, labels on the response only, a collator.

The seed recipe's second stage trains on `{"instruction", "input", "output"}` records: the instruction (and its
optional input) filled into a prompt template, the output as the response. Only the response is learned: every
prompt token gets the label -100, so it never reaches the loss.

    records = read_instruction_records("data.jsonl")            # checked: every problem named by line number
    examples, report = tokenize_records(records, tokenizer, template=PromptTemplate.named("alpaca"),
                                        max_seq_length=512)      # input_ids + labels (-100 on the prompt)
    trainer = Trainer(..., train_dataset=examples, data_collator=InstructionCollator(tokenizer.pad_token_id))

Records longer than `max_seq_length` keep their whole response when it fits beside at least the end of the prompt
(the prompt is cut from the front, its first token kept); otherwise the prompt keeps the half of the window it
needs and the response loses its end. `TruncationReport` counts both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_llmkit.data.json_text import JSON_WHITESPACE, json_array_values, json_lines

__all__ = [
    "ALPACA",
    "IGNORE_INDEX",
    "RECORD_KEYS",
    "InstructionCollator",
    "PromptTemplate",
    "TruncationReport",
    "check_length_budget",
    "longest_token",
    "pack_examples",
    "read_instruction_records",
    "tokenize_record",
    "tokenize_records",
]

IGNORE_INDEX = -100  # the label cross-entropy skips (transformers' and torch's default ignore_index)
RECORD_KEYS = ("instruction", "input", "output")
_REQUIRED = ("instruction", "output")  # "input" may be left out (an empty input)


@dataclass(frozen=True)
class PromptTemplate:
    """How a record becomes a prompt: `with_input` when the record has an input, else `without_input`.

    Both are format strings with `{instruction}` (and `{input}` for `with_input`). `PromptTemplate.named("alpaca")`
    is Stanford Alpaca's; `PromptTemplate.parse(text)` reads a name or one format string (used for both cases, an
    empty input filling `{input}`)."""

    with_input: str
    without_input: str

    @classmethod
    def named(cls, name: str) -> PromptTemplate:
        if name not in TEMPLATES:
            raise ValueError(f"unknown prompt template {name!r}; use one of {', '.join(TEMPLATES)} or a format string")
        return TEMPLATES[name]

    @classmethod
    def parse(cls, text: str) -> PromptTemplate:
        """A template name, or a format string with `{instruction}` (and optionally `{input}`)."""
        if "{" not in text:
            return cls.named(text)
        try:
            text.format(instruction="", input="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"prompt template {text!r} is not a format string of {{instruction}} and {{input}} ({err!r}); "
                "escape literal braces as {{ }}"
            ) from None
        if "{instruction}" not in text:
            raise ValueError(f"prompt template {text!r} has no {{instruction}} field; add it")
        return cls(text, text)

    def check_records(self, records: Sequence[dict[str, str]], *, flag: str = "--prompt_template") -> None:
        """`ValueError` when records have an input and the template has no `{input}`: every input would be dropped."""
        if "{input}" in self.with_input:
            return
        having = [index for index, record in enumerate(records, start=1) if record.get("input", "").strip()]
        if having:
            raise ValueError(
                f"{flag} {self.with_input!r} has no {{input}} field, and {len(having)} of the {len(records)} records "
                f"have an input (record {having[0]} the first) that it would drop; add {{input}} to the template"
            )

    def prompt(self, record: dict[str, str]) -> str:
        text = record.get("input", "")
        return (self.with_input if text else self.without_input).format(instruction=record["instruction"], input=text)


ALPACA = PromptTemplate(
    with_input="Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
    without_input="Below is an instruction that describes a task. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n",
)
TEMPLATES = {"alpaca": ALPACA}


def _decode(path: Path) -> str:
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte offset {err.start}); convert it to UTF-8") from None
    if not text.strip():
        raise ValueError(f"{path} is empty; add instruction records")
    return text


def _json_values(path: Path, text: str) -> Iterable[tuple[int, Any]]:
    """(line number, value) of each element of a JSON array file, or of each line of a JSON lines file (split on
    "\\n" only: U+2028 and the like inside a string are data)."""
    if text.lstrip(JSON_WHITESPACE).startswith("["):
        yield from json_array_values(text, where=str(path))
        return
    for number, line in json_lines(text):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path} line {number} is not valid JSON ({err.msg} at column {err.colno}); "
                    "write one JSON object per line"
                ) from None


def read_instruction_records(path: str | os.PathLike) -> list[dict[str, str]]:
    """The `{"instruction", "input", "output"}` records of a `.json` (array) or `.jsonl` file, every one checked:
    a missing key, a value that is not a string, or a row that is not an object raises `ValueError` with its line."""
    path = Path(path)
    records = []
    for line, value in _json_values(path, _decode(path)):
        where = f"{path} line {line}"
        if not isinstance(value, dict):
            raise ValueError(f'{where} is a JSON {type(value).__name__}; write objects like {{"instruction": ...}}')
        missing = [key for key in _REQUIRED if key not in value]
        if missing:
            found = ", ".join(sorted(value)[:6]) or "none"
            raise ValueError(f"{where} has no {' or '.join(map(repr, missing))} (keys: {found}); add it")
        for key in RECORD_KEYS:
            if key in value and not isinstance(value[key], str):
                kind = "null" if value[key] is None else type(value[key]).__name__
                raise ValueError(f"{where}: {key!r} is {kind}, not a string; make it a string")
        records.append({key: value.get(key, "") for key in RECORD_KEYS})
    if not records:
        raise ValueError(f"{path} holds no records; add {{'instruction', 'input', 'output'}} objects")
    return records


@dataclass
class TruncationReport:
    """What `tokenize_records` did to records longer than the window."""

    records: int = 0
    prompt_cut: int = 0  # kept their whole response, the prompt lost its front
    response_cut: int = 0  # lost the end of their response
    empty_response: list[int] = field(default_factory=list)  # indices of records with nothing to learn

    def describe(self, max_seq_length: int) -> str | None:
        """One line for the log, or None when nothing was cut."""
        if not self.prompt_cut and not self.response_cut:
            return None
        return (
            f"{self.prompt_cut + self.response_cut} of {self.records} records are longer than --max_seq_length "
            f"{max_seq_length}: {self.prompt_cut} kept their whole response (prompt shortened), "
            f"{self.response_cut} lost the end of their response; raise --max_seq_length to keep them whole"
        )


# Tokens tokenized beyond what a cut keeps: the ids next to where a long text was cut for tokenizing may differ from
# the whole text's, and are never kept.
_SLACK = 8
# A text is cut for tokenizing at a whitespace after this many characters per token it may need, at least
# (normalizers may shrink a text a little; a token covers at most its vocabulary string's length).
_CHARS_PER_TOKEN_FACTOR = 4


def longest_token(tokenizer: Any) -> int:
    """The longest vocabulary string of `tokenizer`, in characters: no token covers more of a text."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) + 1


def _cut_at_space(text: str, lo: int, hi: int, *, last: bool) -> int | None:
    """A position in [lo, hi] where whitespace follows a non-whitespace character (the end of a word in every
    pre-tokenizer): the last such one, or the first with `last=False`; None when there is none."""
    window = (
        range(min(hi, len(text) - 1), max(lo, 1) - 1, -1) if last else range(max(lo, 1), min(hi, len(text) - 1) + 1)
    )
    return next((i for i in window if text[i].isspace() and not text[i - 1].isspace()), None)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _head(tokenizer: Any, text: str, count: int, longest: int) -> tuple[list[int], bool]:
    """(the first ids of `text`, whether they are all of them): all its ids, or for a text of more than `count`
    tokens at least `count + 1` of its first, tokenizing only a prefix that ends at a word's end (a 50 MB record
    once took 10 GB and minutes to tokenize whole, for a window of a few hundred tokens)."""
    need = (count + _SLACK) * longest * _CHARS_PER_TOKEN_FACTOR
    cut = _cut_at_space(text, need, 2 * need, last=False) if len(text) > 2 * need else None
    if cut is None:
        return _ids(tokenizer, text), True
    ids = _ids(tokenizer, text[:cut])[:-_SLACK]  # the last ids of a prefix may differ from the whole text's
    return (ids, False) if len(ids) > count else (_ids(tokenizer, text), True)


def _tail(tokenizer: Any, text: str, count: int, longest: int) -> list[int]:
    """At least the last `count` ids of `text` (a long one: tokenizing only a suffix that starts at a word's end)."""
    need = (count + _SLACK) * longest * _CHARS_PER_TOKEN_FACTOR
    cut = _cut_at_space(text, len(text) - 2 * need, len(text) - need, last=True) if len(text) > 2 * need else None
    if cut is None:
        return _ids(tokenizer, text)
    ids = _ids(tokenizer, text[cut:])[_SLACK:]  # the first ids of a suffix may differ from the whole text's
    return ids if len(ids) >= count else _ids(tokenizer, text)


def tokenize_record(
    record: dict[str, str],
    tokenizer: Any,
    *,
    template: PromptTemplate,
    max_seq_length: int,
    wrap: tuple[Sequence[int], Sequence[int]] = ((), ()),
    longest: int | None = None,
) -> tuple[dict[str, list[int]], str | None]:
    """`input_ids` and `labels` (-100 on the prompt) of one record, and what truncation did ("prompt", "response"
    or None). `wrap` = (ids before, ids after) the example that are never learned (P-tuning v1's template).
    `longest`: `longest_token(tokenizer)` (computed when not given). A prompt or response far longer than the window
    is tokenized only where the kept tokens come from: the same ids, in memory and time that follow the window."""
    longest = longest or longest_token(tokenizer)
    room = max_seq_length - len(wrap[0]) - len(wrap[1])
    if room < 2:  # not even a BOS and one response token: every cut below would misbehave
        raise ValueError(
            f"max_seq_length {max_seq_length} leaves {room} tokens beside the {len(wrap[0]) + len(wrap[1])} wrapped "
            "around each example; raise it (check_length_budget gives the least that holds one example)"
        )
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prompt_text = template.prompt(record)
    prompt, whole = _head(tokenizer, prompt_text, room, longest)
    prompt = [*bos, *prompt]
    ending = prompt if whole else [*bos, *_tail(tokenizer, prompt_text, room, longest)]  # its last ids
    response, whole = _head(tokenizer, record["output"], room, longest)
    if response and whole and tokenizer.eos_token_id is not None:
        response = [*response, tokenizer.eos_token_id]  # an empty response teaches nothing, not even the end
    cut = None
    if len(prompt) + len(response) > room:
        floor = min(len(prompt), room // 2)  # the prompt keeps at least this much, even against the response
        cut = "prompt" if room - len(response) >= floor else "response"
        keep = room - len(response) if cut == "prompt" else floor  # prompt tokens kept
        prompt = prompt[:1] + ending[len(ending) - keep + 1 :] if keep > 1 else prompt[:keep]
        response = response[: room - len(prompt)]
    input_ids = [*wrap[0], *prompt, *response, *wrap[1]]
    labels = [IGNORE_INDEX] * (len(wrap[0]) + len(prompt)) + response + [IGNORE_INDEX] * len(wrap[1])
    return {"input_ids": input_ids, "labels": labels}, cut


def check_length_budget(
    tokenizer: Any,
    template: PromptTemplate,
    max_seq_length: int,
    *,
    wrap: tuple[Sequence[int], Sequence[int]] = ((), ()),
    wrap_name: str = "the P-tuning template (--num_virtual_tokens, --ptuning_template)",
) -> None:
    """`ValueError` naming the flags when `max_seq_length` cannot hold one example: what the model sees besides the
    record's own text (`wrap`'s tokens, the BOS token, the template's fixed text) and one response token with its end
    of text. A flag conflict, found before tokenising, not records blamed for it later."""
    fixed = len(
        tokenizer(template.without_input.format(instruction="", input=""), add_special_tokens=False)["input_ids"]
    )
    bos, eos = int(tokenizer.bos_token_id is not None), int(tokenizer.eos_token_id is not None)
    wrapped = len(wrap[0]) + len(wrap[1])
    need = wrapped + bos + fixed + 1 + eos
    if max_seq_length < need:
        parts = [f"{wrapped} tokens of {wrap_name}"] if wrapped else []
        parts += [f"{bos + fixed} of the prompt template (--prompt_template)", f"{1 + eos} for a one-token response"]
        raise ValueError(
            f"--max_seq_length {max_seq_length} cannot hold one example: {', '.join(parts)} make {need}; pass "
            f"--max_seq_length {need} or more" + (", or fewer virtual tokens" if wrapped else "")
        )


def tokenize_records(
    records: Sequence[dict[str, str]],
    tokenizer: Any,
    *,
    template: PromptTemplate,
    max_seq_length: int,
    wrap: tuple[Sequence[int], Sequence[int]] = ((), ()),
) -> tuple[list[dict[str, list[int]]], TruncationReport]:
    """Every record tokenized by `tokenize_record`, and a `TruncationReport` of the whole set."""
    report = TruncationReport(records=len(records))
    examples = []
    longest = longest_token(tokenizer)
    for index, record in enumerate(records):
        example, cut = tokenize_record(
            record, tokenizer, template=template, max_seq_length=max_seq_length, wrap=wrap, longest=longest
        )
        report.prompt_cut += cut == "prompt"
        report.response_cut += cut == "response"
        if all(label == IGNORE_INDEX for label in example["labels"]):
            report.empty_response.append(index)
        examples.append(example)
    return examples, report


def pack_examples(examples: Sequence[dict[str, list[int]]], max_seq_length: int) -> list[dict[str, list[int]]]:
    """Consecutive examples concatenated into sequences of at most `max_seq_length` tokens (each example whole,
    in order); labels keep their -100s, so a pack learns exactly its examples' responses. Examples of one pack
    attend to the earlier ones, as grouped pre-training text does."""
    packs: list[dict[str, list[int]]] = []
    for example in examples:
        if packs and len(packs[-1]["input_ids"]) + len(example["input_ids"]) <= max_seq_length:
            packs[-1]["input_ids"] += example["input_ids"]
            packs[-1]["labels"] += example["labels"]
        else:
            packs.append({"input_ids": list(example["input_ids"]), "labels": list(example["labels"])})
    return packs


class InstructionCollator:
    """Pads a batch of examples on the right: `input_ids` with `pad_token_id`, `labels` with -100; the attention
    mask is 1 on the examples' tokens and 0 on the padding (optionally to a multiple of `pad_to_multiple_of`)."""

    def __init__(self, pad_token_id: int, *, pad_to_multiple_of: int | None = None) -> None:
        if pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos_token)")
        self.pad_token_id, self.pad_to_multiple_of = pad_token_id, pad_to_multiple_of

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        length = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(features), length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(features), length), dtype=torch.long)
        for row, feature in enumerate(features):
            n = len(feature["input_ids"])
            input_ids[row, :n] = torch.as_tensor(feature["input_ids"])
            labels[row, :n] = torch.as_tensor(feature["labels"])
            mask[row, :n] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
