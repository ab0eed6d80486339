"""Causal-LM data: raw texts -> tokenized -> grouped into fixed-size blocks -> train/validation split.

The pipeline of the Chinese-LLaMA-Alpaca-2 pre-training recipe: tokenize each row (an end-of-text token after it),
concatenate, cut into `block_size` blocks (labels = inputs; the model shifts them), then a seeded split (or a
held-out validation text). Rows are grouped 2,000 at a time, as the recipe's `datasets.map(batch_size=2000)` does
(the tail of each group, under one block, is dropped).

Memory does not grow with the data: the rows are streamed (`hf_llmkit.data.files.TextFiles`; a row longer than
`PIECE_CHARS` characters is tokenized in pieces), tokenized a bounded batch at a time, and the blocks are written to
an Arrow file as they come (a group of huge rows `GROUP_TOKENS` tokens at a time: the same blocks). The split then
streams that file one record batch at a time through plain reads into the two split files, and the result is
memory-mapped from them: nothing reads the data through a memory map while building, and opening them maps a few
pages per record batch of `_WRITE_TOKENS` tokens, so neither the process's own memory nor its mapped pages grow with
the file (but for those few pages: about 64 KiB per million tokens). The validation blocks are a seeded, uniformly
random choice of the blocks; both splits keep the order of the text (the Trainer shuffles the training blocks).

The result is cached under a key of everything that decides the blocks: the sources' content (sha256 of each file's
bytes, or of the texts), the whole tokenizer (its serialized vocabulary, merges, normalizer and pre-tokenizer, and the
end-of-text token), the block size, and either the validation text's content or the split percentage with its seed.
So a second run (or the other ranks) reuses it and nothing else is ever served from it. A cache entry is a folder of
two Arrow files (`train.arrow`, `validation.arrow`), published whole by a rename. `max_train_samples` /
`max_eval_samples` select from the loaded splits afterwards. A write killed half way leaves a temporary folder that
the next build in the same cache folder removes (`hf_llmkit.data.cache`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
from datasets import Dataset, DatasetDict, NamedSplit
from transformers import PreTrainedTokenizerBase

from hf_llmkit.checkpoints.names import path_too_long, shown_path
from hf_llmkit.checkpoints.retries import describe_write_error, write_errno
from hf_llmkit.data.cache import publish_once, remove_stale_temporaries
from hf_llmkit.data.files import TextFiles, split_long_text

__all__ = ["build_lm_datasets", "validation_block_count"]

GROUP_ROWS = 2000  # rows concatenated before cutting blocks (the recipe's map batch size)
GROUP_TOKENS = 1 << 20  # a group of more tokens is cut into blocks this many at a time (the same blocks)
# tokens per Arrow record batch of the file of all blocks, which the split reads a batch at a time
_READ_TOKENS = 1 << 17
# tokens per record batch of the split files: opening a memory-mapped Arrow file reads every batch's header, and the
# kernel maps the pages around each read (fault-around, 64 KiB) into the process: fewer batches, fewer such pages
_WRITE_TOKENS = 1 << 20
_SPLITS = ("train", "validation")  # a cache entry: one Arrow stream file of blocks per split, <split>.arrow
_MAX_SPLIT_BLOCKS = 10**9  # numpy's hypergeometric sampler takes populations under this
_TOKENIZE_ROWS, _TOKENIZE_CHARS = 1000, 1 << 18  # one tokenizer call: at most this many rows / characters
_CACHE_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.ENAMETOOLONG}
# the types `datasets.map` gives these columns (its optimized integer types for token ids and masks)
_SCHEMA = pa.schema(
    [("input_ids", pa.list_(pa.int32())), ("attention_mask", pa.list_(pa.int8())), ("labels", pa.list_(pa.int64()))]
)


def _file_digest(path: Path) -> bytes:
    """sha256 of the file's bytes: the cache follows the content (an edit that keeps size and mtime, a copy)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.digest()


def _tokenizer_digest(tokenizer) -> bytes:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    described = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    special = json.dumps([type(tokenizer).__name__, tokenizer.eos_token_id, str(tokenizer.special_tokens_map)])
    return hashlib.sha256(f"{described}\0{special}".encode()).digest()


def _source_digest(files: Sequence[Path], texts: Iterable[str] | None) -> bytes:
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.suffix}:".encode())  # .txt and .json of the same bytes read differently
        digest.update(_file_digest(path))
    if isinstance(texts, TextFiles):
        digest.update(_source_digest(texts.files, None))
        if texts.rows != "line":  # the same .txt bytes cut into other rows
            digest.update(f"rows:{texts.rows}".encode())
    else:
        for text in texts or ():
            digest.update(hashlib.sha256(text.encode()).digest())
    return digest.digest()


def _cache_key(sources: bytes, tokenizer, block_size: int, split: str) -> str:
    digest = hashlib.sha256(sources + _tokenizer_digest(tokenizer))
    digest.update(f"{block_size}:{split}:v4".encode())
    return digest.hexdigest()[:16]


def validation_block_count(blocks: int, percentage: float) -> int:
    """Blocks held out for `percentage` percent of `blocks`: at least 1, and at least 1 left to train on."""
    if not 0 < percentage < 100:
        raise ValueError(f"--validation_split_percentage {percentage} must be between 0 and 100 (exclusive)")
    if blocks < 2:
        raise ValueError(f"the data gives {blocks} block(s); a train/validation split needs at least 2")
    return min(max(1, math.ceil(blocks * percentage / 100)), blocks - 1)  # datasets' rounding for a float test_size


def _pieces(files: Sequence[Path], texts: Iterable[str] | None) -> Iterator[tuple[str, bool]]:
    """(text, ends its row) of the texts, then of the files' rows; long rows come in pieces."""
    if isinstance(texts, TextFiles):
        yield from texts.pieces()
    else:
        for text in texts or ():
            pieces = list(split_long_text(text)) or [""]  # an empty row still ends with an end-of-text token
            yield from ((piece, index == len(pieces) - 1) for index, piece in enumerate(pieces))
    if files:
        yield from TextFiles(files).pieces()


class _Grouper:
    """Concatenates tokenized rows into whole blocks. `GROUP_ROWS` rows make a group, whose tail (under one block)
    is dropped, as the recipe does; a group that reaches `GROUP_TOKENS` tokens hands out its whole blocks so far and
    keeps its tail, so memory is bounded and the blocks are those of the whole group."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.parts: list[np.ndarray] = []
        self.rows = self.tokens = 0

    def add(self, ids: np.ndarray, ends_row: bool) -> np.ndarray | None:
        self.parts.append(ids)
        self.rows, self.tokens = self.rows + ends_row, self.tokens + len(ids)
        if self.rows >= GROUP_ROWS:
            return self.close()
        return self._whole_blocks() if self.tokens >= GROUP_TOKENS else None

    def _whole_blocks(self) -> np.ndarray:
        ids = np.concatenate(self.parts)
        usable = len(ids) // self.block_size * self.block_size
        self.parts = [ids[usable:].copy()]  # a copy: the group's array is not kept alive by its tail
        self.tokens = len(ids) - usable
        return ids[:usable]

    def close(self) -> np.ndarray | None:
        blocks = self._whole_blocks() if self.parts else None
        self.parts, self.rows, self.tokens = [], 0, 0
        return blocks


def _groups(pieces: Iterator[tuple[str, bool]], tokenizer, eos: int | None, block_size: int) -> Iterator[np.ndarray]:
    """Token ids, whole blocks of them (`_Grouper`), one array at a time; tokenized a bounded batch at a time."""
    grouper, batch, chars = _Grouper(block_size), [], 0
    for piece in _with_end(pieces):
        if piece is not None:
            batch.append(piece)
            chars += len(piece[0])
            if len(batch) < _TOKENIZE_ROWS and chars < _TOKENIZE_CHARS:
                continue
        if batch:
            ids = tokenizer([text for text, _ in batch], add_special_tokens=False, verbose=False)["input_ids"]
            for (_, ends), seq in zip(batch, ids):
                group = grouper.add(np.asarray(seq + [eos] if ends and eos is not None else seq, np.int64), ends)
                if group is not None:
                    yield group
            batch, chars = [], 0
    group = grouper.close()
    if group is not None:
        yield group


def _with_end(pieces: Iterator[tuple[str, bool]]) -> Iterator[tuple[str, bool] | None]:
    yield from pieces
    yield None


def _record_batch(blocks: np.ndarray) -> pa.RecordBatch:
    """The record batch of a 2-D array of token ids, one block a row (labels = input ids)."""
    flat = np.ascontiguousarray(blocks, dtype=np.int64).ravel()
    offsets = pa.array(np.arange(0, flat.size + 1, blocks.shape[1], dtype=np.int32))
    columns = [
        pa.ListArray.from_arrays(offsets, pa.array(flat.astype(np.int32))),
        pa.ListArray.from_arrays(offsets, pa.array(np.ones(flat.size, dtype=np.int8))),
        pa.ListArray.from_arrays(offsets, pa.array(flat)),
    ]
    return pa.record_batch(columns, schema=_SCHEMA)


@contextlib.contextmanager
def _block_writer(path: Path, rows: int) -> Iterator[Callable[[np.ndarray], None]]:
    """`write(blocks)` (a 2-D array of token ids, one block a row) for the Arrow stream file `path`: written in record
    batches of `rows` blocks (the last one fewer), so neither a large array nor many small ones make a batch."""
    pending: list[np.ndarray] = []
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, _SCHEMA) as writer:

        def flush() -> None:
            if pending:
                blocks = np.concatenate(pending) if len(pending) > 1 else pending[0]
                pending.clear()
                writer.write_batch(_record_batch(blocks))

        def write(blocks: np.ndarray) -> None:
            for start in range(0, len(blocks), rows):
                pending.append(blocks[start : start + rows])
                if sum(map(len, pending)) >= rows:
                    flush()

        yield write
        flush()


def _write_blocks(pieces: Iterator[tuple[str, bool]], tokenizer, block_size: int, path: Path, what: str, rows: int):
    """Write every block of the texts to the Arrow stream file `path`, `rows` blocks a batch; returns how many."""
    count = 0
    with _block_writer(path, rows) as write:
        for ids in _groups(pieces, tokenizer, tokenizer.eos_token_id, block_size):
            write(ids.reshape(-1, block_size))
            count += len(ids) // block_size
    if count == 0:
        raise ValueError(f"the {what} text gives 0 blocks of {block_size} tokens; add text or lower --block_size")
    return count


def _split_blocks(source: Path, out: Path, block_size: int, blocks: int, held: int, seed: int) -> None:
    """Write `held` of the `blocks` blocks of the Arrow file `source`, a uniformly random choice made with `seed`,
    to out/validation.arrow and the others to out/train.arrow, both in `source`'s order.

    One record batch at a time, read with plain reads (pages read through a memory map would stay in the process's
    resident memory): how many of a batch's blocks are held out is drawn from the hypergeometric distribution of
    the blocks left, then which ones; together, exactly `held` blocks, every choice of them equally likely."""
    if blocks >= _MAX_SPLIT_BLOCKS:
        raise ValueError(
            f"the data gives {blocks} blocks, too many to split by a percentage; "
            "pass --validation_file (a held-out text) or a larger --block_size"
        )
    rng, left, rows = np.random.default_rng(seed), blocks, max(1, _WRITE_TOKENS // block_size)
    with contextlib.ExitStack() as stack:
        reader = pa.ipc.open_stream(stack.enter_context(pa.OSFile(str(source), "rb")))
        train, validation = (stack.enter_context(_block_writer(out / f"{name}.arrow", rows)) for name in _SPLITS)
        for batch in reader:
            ids = batch.column("labels").flatten().to_numpy().reshape(-1, block_size)
            take = int(rng.hypergeometric(len(ids), left - len(ids), held)) if left > len(ids) else held
            chosen = np.zeros(len(ids), dtype=bool)
            chosen[rng.choice(len(ids), take, replace=False)] = True
            train(ids[~chosen])
            validation(ids[chosen])
            left, held = left - len(ids), held - take


def _build(out: Path, *, tokenizer, block_size, files, texts, validation_texts, percentage, seed) -> None:
    """Write the blocks of both splits into the folder `out` (`_SPLITS`)."""
    if validation_texts is not None:
        rows = max(1, _WRITE_TOKENS // block_size)
        _write_blocks(_pieces(files, texts), tokenizer, block_size, out / "train.arrow", "training", rows)
        _write_blocks(
            _pieces((), validation_texts), tokenizer, block_size, out / "validation.arrow", "validation", rows
        )
        return
    every = out / "blocks.arrow"
    rows = max(1, _READ_TOKENS // block_size)
    blocks = _write_blocks(_pieces(files, texts), tokenizer, block_size, every, "training", rows)
    _split_blocks(every, out, block_size, blocks, validation_block_count(blocks, percentage), seed)
    every.unlink()


def _load(folder: Path, in_memory: bool) -> DatasetDict:
    return DatasetDict(
        {
            split: Dataset.from_file(str(folder / f"{split}.arrow"), split=NamedSplit(split), in_memory=in_memory)
            for split in _SPLITS
        }
    )


def build_lm_datasets(
    *,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    files: Sequence[Path] = (),
    texts: Iterable[str] | TextFiles | None = None,
    validation_texts: Iterable[str] | TextFiles | None = None,
    validation_split_percentage: float = 5.0,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
    seed: int = 42,
) -> DatasetDict:
    """Tokenized, grouped `train` and `validation` splits of `texts` (strings, or `TextFiles`) and of `files`.

    The validation split is `validation_texts` when given, else `validation_split_percentage` percent of the
    blocks (at least one), chosen with `seed`. With `cache_dir`, the result is stored there and reloaded on later
    calls with the same inputs. (`num_proc`, the recipe's `--preprocessing_num_workers`, is accepted and unused:
    rows are tokenized in batches in this process, and a fast tokenizer spreads a batch over the cores itself.)
    """
    del num_proc
    files = [Path(path) for path in files]
    if validation_texts is None:
        validation_block_count(2, validation_split_percentage)  # range check before any work
        split = f"split {validation_split_percentage} seed {seed}"
    else:
        split = "held out " + _source_digest((), validation_texts).hex()
    build = dict(
        tokenizer=tokenizer, block_size=block_size, files=files, texts=texts, validation_texts=validation_texts,
        percentage=validation_split_percentage, seed=seed,
    )  # fmt: skip
    if cache_dir is None:
        with tempfile.TemporaryDirectory(prefix="hf_llmkit_blocks_") as work:
            _build(Path(work), **build)
            return _load(Path(work), in_memory=True)
    cache = Path(cache_dir)
    too_long = path_too_long(cache)
    if too_long:
        raise ValueError(f"the cache folder {shown_path(cache)} {too_long}; pass --data_cache_dir with a shorter path")
    target = cache / f"lm-blocks-{_cache_key(_source_digest(files, texts), tokenizer, block_size, split)}"

    def write(tmp: Path) -> None:
        tmp.mkdir()
        _build(tmp, **build)

    if not all((target / f"{name}.arrow").is_file() for name in _SPLITS):  # an entry is published whole
        try:
            cache.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(cache)  # what killed builds left behind
            publish_once(target, write)
        except OSError as err:
            if write_errno(err) not in _CACHE_WRITE_ERRORS:
                raise
            raise ValueError(
                f"cannot write the tokenized data into the cache folder {cache}: {describe_write_error(err, cache)}; "
                "free space there, or pass --data_cache_dir on another disk (or with a shorter path)"
            ) from err
    return _load(target, in_memory=False)
