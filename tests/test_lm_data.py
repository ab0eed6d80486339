"""The tokenized data cache follows everything that decides the blocks: the files' content (an edit that keeps size
and mtime is never served stale; the same bytes under another path reuse the cached blocks), the split seed and the
held-out text (issue 11, section 5; issue 21, section 3). Tokenization streams (a large single-line file in bounded
memory), a killed cache write leaves nothing behind after the next build, and a cache folder that cannot be written
is one line naming it and the fix."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_llmkit.data_files import TextFiles
from hf_llmkit.lm_data import build_lm_datasets

MEMORY_RUN = Path(__file__).with_name("lm_data_memory_run.py")


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


def test_cache_key_covers_the_split_seed_and_the_held_out_text(tmp_path):
    corpus, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    corpus.write_text("".join(f"w{i % 10} w{(i * 3) % 10} w{(i * 7) % 10}\n" for i in range(200)))

    def validation(**kwargs):
        data = build_lm_datasets(tokenizer=_tokenizer(), block_size=4, files=[corpus], cache_dir=cache, **kwargs)
        return [tuple(row) for row in data["validation"]["input_ids"]]

    warm = validation(seed=42)
    assert validation(seed=7) != warm and validation(seed=42) == warm  # a warm seed-42 cache never serves seed 7
    held = tmp_path / "held.txt"
    held.write_text("w1 w2 w3 w4 w5\n")
    assert validation(seed=42, validation_texts=TextFiles([held])) == [(3, 4, 5, 6)]
    held.write_text("w5 w4 w3 w2 w1\n")
    assert validation(seed=42, validation_texts=TextFiles([held])) == [(7, 6, 5, 4)]
    assert len(list(cache.iterdir())) == 4


def test_a_full_or_unusable_cache_folder_is_one_line_naming_it_and_the_fix(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("w1 w2 w3 w4 w5 w6 w7\n" * 2000)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write over the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(ValueError) as error:
            build_lm_datasets(tokenizer=_tokenizer(), block_size=4, files=[corpus], cache_dir=tmp_path / "cache")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    message = str(error.value)
    assert message.startswith(f"cannot write the tokenized data into the cache folder {tmp_path / 'cache'}: file too")
    assert "pass --data_cache_dir on another disk" in message and "\n" not in message
    assert not [p for p in (tmp_path / "cache").iterdir()]  # nothing half-written stays
    with pytest.raises(ValueError, match="cache folder .* has a name of 300 bytes.*pass --data_cache_dir with a"):
        build_lm_datasets(tokenizer=_tokenizer(), block_size=4, files=[corpus], cache_dir=tmp_path / ("c" * 300))


@pytest.fixture(scope="module")
def big_single_line(tmp_path_factory):
    """Two runs of tests/lm_data_memory_run.py at once on a single-line file of 4 MB: one to the end (its peak
    memory), one killed while it writes into its cache folder."""
    work = tmp_path_factory.mktemp("big")
    command = [sys.executable, str(MEMORY_RUN)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    measured = subprocess.Popen([*command, str(work / "measured"), "4"], stdout=subprocess.PIPE, text=True, env=env)
    killed = subprocess.Popen([*command, str(work / "killed"), "4"], stdout=subprocess.DEVNULL, env=env)
    cache = work / "killed" / "cache"
    deadline = time.monotonic() + 240
    while not list(cache.glob("*.tmp-*")) and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    out, _ = measured.communicate(timeout=400)
    assert measured.returncode == 0
    return json.loads(out.strip().splitlines()[-1]), cache


def test_a_large_single_line_file_tokenizes_in_bounded_memory(big_single_line):
    result, _ = big_single_line
    # The whole line at once took about 650 MB more (a 160-byte-per-character tokenizer buffer, the text and its
    # rows in memory twice). Streamed in pieces, the process's own (anonymous) memory is bounded by one group of
    # GROUP_TOKENS tokens: sampled, +69 / +142 / +174 / +180 MB at 4 / 32 / 64 / 128 MB of text. The pages of the
    # Arrow files datasets memory-maps still count in RSS and grow with the data (+15 / +103 / +195 / +401 MB).
    assert result["blocks"] > 7000 and result["added_mb"] < 200, result


def test_a_killed_cache_write_leaves_nothing_after_the_next_build(big_single_line, tmp_path):
    _, cache = big_single_line
    assert list(cache.glob("*.tmp-*")), "the killed run was not caught writing"
    small = tmp_path / "small.txt"
    small.write_text("w1 w2 w3 w4 w5 w6 w7\n" * 20)
    build_lm_datasets(tokenizer=_tokenizer(), block_size=4, files=[small], cache_dir=cache)
    assert [p.name for p in cache.iterdir() if ".tmp-" in p.name] == []
