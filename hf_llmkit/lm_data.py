"""Causal-LM data: raw texts -> tokenized -> grouped into fixed-size blocks -> train/validation split.

The pipeline of the Chinese-LLaMA-Alpaca-2 pre-training recipe, with `datasets`: `map` to tokenize, `map` to
concatenate and cut into `block_size` blocks (labels = inputs; the model shifts them), a seeded split (or a
held-out validation text), and the processed result cached with `save_to_disk` under a key made of the sources'
content (sha256 of each file's bytes), the tokenizer and the block size, so a second run (or the other ranks)
reuses it and an edited file is never served from a stale cache. Reading and checking the user's files is
`hf_llmkit.data_files`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from datasets import Dataset, DatasetDict, load_from_disk
from transformers import PreTrainedTokenizerBase

from hf_llmkit.cache_folder import publish_once
from hf_llmkit.data_files import read_text_rows

__all__ = ["build_lm_datasets", "validation_block_count"]


def _file_digest(path: Path) -> bytes:
    """sha256 of the file's bytes: the cache follows the content (an edit that keeps size and mtime, a copy)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.digest()


def _cache_key(files: Sequence[Path], texts: Sequence[str] | None, tokenizer, block_size: int, split: float) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.suffix}:".encode())  # .txt and .json of the same bytes read differently
        digest.update(_file_digest(path))
    for text in texts or ():
        digest.update(text.encode())
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    digest.update(hashlib.sha256(vocab.encode()).digest())
    digest.update(f"{type(tokenizer).__name__}:{block_size}:{split}:v2".encode())
    return digest.hexdigest()[:16]


def validation_block_count(blocks: int, percentage: float) -> int:
    """Blocks held out for `percentage` percent of `blocks`: at least 1, and at least 1 left to train on."""
    if not 0 < percentage < 100:
        raise ValueError(f"--validation_split_percentage {percentage} must be between 0 and 100 (exclusive)")
    if blocks < 2:
        raise ValueError(f"the data gives {blocks} block(s); a train/validation split needs at least 2")
    return min(max(1, math.ceil(blocks * percentage / 100)), blocks - 1)  # datasets' rounding for a float test_size


def _blocks(texts: Dataset, tokenizer, block_size: int, num_proc: int | None, what: str) -> Dataset:
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        # Documents longer than the model's context are expected here: they are cut into blocks below.
        ids = tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]
        return {"input_ids": [seq + [eos] if eos is not None else seq for seq in ids]}

    def group(batch):
        flat = [tok for seq in batch["input_ids"] for tok in seq]
        usable = len(flat) // block_size * block_size
        blocks = [flat[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks], "labels": blocks}

    tokenized = texts.map(
        tokenize, batched=True, remove_columns=texts.column_names, num_proc=num_proc, desc="Tokenize"
    )
    # Large batches keep the tail dropped by grouping negligible (at most block_size-1 tokens per 2,000 rows).
    blocks = tokenized.map(group, batched=True, batch_size=2000, num_proc=num_proc, desc=f"Group into {block_size}")
    if len(blocks) == 0:
        raise ValueError(f"the {what} text gives 0 blocks of {block_size} tokens; add text or lower --block_size")
    return blocks


def build_lm_datasets(
    *,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    files: Sequence[Path] = (),
    texts: Sequence[str] | None = None,
    validation_texts: Sequence[str] | None = None,
    validation_split_percentage: float = 5.0,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
    seed: int = 42,
) -> DatasetDict:
    """Tokenized, grouped `train` and `validation` splits of `texts` (or of the rows of `files`).

    The validation split is `validation_texts` when given, else `validation_split_percentage` percent of the
    blocks (at least one). With `cache_dir`, the result is stored there and reloaded on later calls with the
    same inputs.
    """
    if validation_texts is None:
        validation_block_count(2, validation_split_percentage)  # range check before any work
    target = None
    if cache_dir is not None:
        key = _cache_key(files, texts, tokenizer, block_size, validation_split_percentage)
        if validation_texts is not None:
            held_out = _cache_key((), validation_texts, tokenizer, block_size, 0.0)
            key = hashlib.sha256(f"{key}:{held_out}".encode()).hexdigest()[:16]
        target = Path(cache_dir) / f"lm-blocks-{key}"
        if (target / "dataset_dict.json").is_file():
            return load_from_disk(str(target))
    rows = list(texts or []) + (read_text_rows(files) if files else [])
    train = _blocks(Dataset.from_dict({"text": rows}), tokenizer, block_size, num_proc, "training")
    if validation_texts is not None:
        held = _blocks(
            Dataset.from_dict({"text": list(validation_texts)}), tokenizer, block_size, num_proc, "validation"
        )
        result = DatasetDict(train=train, validation=held)
    else:
        count = validation_block_count(len(train), validation_split_percentage)
        splits = train.train_test_split(test_size=count, seed=seed, shuffle=True)
        result = DatasetDict(train=splits["train"], validation=splits["test"])
    if target is not None:
        publish_once(target, lambda tmp: result.save_to_disk(str(tmp)))
        result = load_from_disk(str(target))
    return result
