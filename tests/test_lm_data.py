"""The tokenized data cache follows the files' content: an edit that keeps size and mtime is never served stale, and
the same bytes under another path reuse the cached blocks (issue 11, section 5)."""

from __future__ import annotations

import os

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_llmkit.lm_data import build_lm_datasets


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[EOS]": 1, **{f"w{i}": i + 2 for i in range(10)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="[EOS]")


def _blocks(path, cache):
    data = build_lm_datasets(tokenizer=_tokenizer(), block_size=4, files=[path], cache_dir=cache, seed=0)
    return sorted(tuple(row) for split in data.values() for row in split["input_ids"])


def test_cache_is_keyed_by_content_not_path_size_or_mtime(tmp_path):
    corpus, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    corpus.write_text("w1 w2 w3 w4 w5 w6 w7\n" * 20)
    first = _blocks(corpus, cache)
    stat = corpus.stat()
    corpus.write_text("w8 w2 w3 w4 w5 w6 w7\n" * 20)  # same size
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime
    edited = _blocks(corpus, cache)
    assert edited != first and any(10 in row for row in edited)  # the edit is seen (w8 is id 10)
    assert len(list(cache.iterdir())) == 2
    copy = tmp_path / "elsewhere" / "copy.txt"
    copy.parent.mkdir()
    copy.write_bytes(corpus.read_bytes())
    assert _blocks(copy, cache) == edited and len(list(cache.iterdir())) == 2  # same bytes: the cached entry
