"""Causal-LM data: raw texts -> tokenized -> grouped into fixed-size blocks -> train/validation split.

The pipeline of the Chinese-LLaMA-Alpaca-2 pre-training recipe, with `datasets`: `map` to tokenize, `map` to
concatenate and cut into `block_size` blocks (labels = inputs; the model shifts them), a seeded split, and
the processed result cached with `save_to_disk` under a key made of the sources' content (sha256 of each file's
bytes), the tokenizer and the block size, so a second run (or the other ranks) reuses it, and an edited file is
never served from a stale cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset, load_from_disk
from transformers import PreTrainedTokenizerBase

from hf_llmkit.cache_folder import publish_once

TEXT_SUFFIXES = {".txt": "text", ".json": "json", ".jsonl": "json"}


def find_data_files(*, dataset_dir: str | None = None, train_file: str | None = None) -> list[Path]:
    """The text/JSON files to train on; raises `ValueError` naming the fix when there are none."""
    if train_file is not None:
        path = Path(train_file)
        if not path.is_file():
            raise ValueError(f"--train_file {train_file} does not exist; pass an existing .txt, .json or .jsonl file")
        if path.suffix not in TEXT_SUFFIXES:
            raise ValueError(
                f"--train_file {train_file}: unsupported suffix {path.suffix!r}; use .txt, .json or .jsonl"
            )
        return [path]
    if dataset_dir is not None:
        folder = Path(dataset_dir)
        if not folder.is_dir():
            raise ValueError(f"--dataset_dir {dataset_dir} is not a folder; pass a folder of .txt/.json/.jsonl files")
        files = sorted(p for p in folder.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise ValueError(
                f"--dataset_dir {dataset_dir} holds no .txt, .json or .jsonl file; add some or use --train_file"
            )
        return files
    return []


def load_texts(files: Sequence[Path]) -> Dataset:
    """One `text` column from every file (text files: one row per line; JSON files: their `text` field)."""
    parts = []
    for path in files:
        kind = TEXT_SUFFIXES[path.suffix]
        # force_redownload: datasets caches a built file by path and mtime; ours is keyed by content, and only a miss
        # of ours gets here, so the file is read afresh.
        part = load_dataset(
            kind, data_files=str(path), split="train", keep_in_memory=True, download_mode="force_redownload"
        )
        if "text" not in part.column_names:
            raise ValueError(f"{path} has no 'text' field (columns: {part.column_names}); rename the field to 'text'")
        parts.append(part.select_columns(["text"]))
    return concatenate_datasets(parts)


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


def build_lm_datasets(
    *,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    files: Sequence[Path] = (),
    texts: Sequence[str] | None = None,
    validation_split_percentage: float = 5.0,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
    seed: int = 42,
) -> DatasetDict:
    """Tokenized, grouped `train` and `validation` splits of `files` (or of in-memory `texts`).

    With `cache_dir`, the result is stored there and reloaded on later calls with the same inputs.
    """
    if not 0 < validation_split_percentage < 100:
        raise ValueError(f"validation_split_percentage={validation_split_percentage} must be in (0, 100)")
    target = None
    if cache_dir is not None:
        key = _cache_key(files, texts, tokenizer, block_size, validation_split_percentage)
        target = Path(cache_dir) / f"lm-blocks-{key}"
        if (target / "dataset_dict.json").is_file():
            return load_from_disk(str(target))
    raw = load_texts(files) if files else Dataset.from_dict({"text": list(texts or [])})
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [seq + [eos] if eos is not None else seq for seq in ids]}

    def group(batch):
        flat = [tok for seq in batch["input_ids"] for tok in seq]
        usable = len(flat) // block_size * block_size
        blocks = [flat[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks], "labels": blocks}

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw.column_names, num_proc=num_proc, desc="Tokenize")
    # Large batches keep the tail dropped by grouping negligible (at most block_size-1 tokens per 2,000 rows).
    blocks = tokenized.map(group, batched=True, batch_size=2000, num_proc=num_proc, desc=f"Group into {block_size}")
    if len(blocks) < 2:
        raise ValueError(
            f"the data gives {len(blocks)} block(s) of {block_size} tokens; add text or lower --block_size"
        )
    splits = blocks.train_test_split(test_size=validation_split_percentage / 100, seed=seed, shuffle=True)
    result = DatasetDict(train=splits["train"], validation=splits["test"])
    if target is not None:
        publish_once(target, lambda tmp: result.save_to_disk(str(tmp)))
        result = load_from_disk(str(target))
    return result
