"""The embedded English corpus and a tokenizer trained on it, so every example runs with no download.

Every CPython ships `pydoc_data.topics.topics`: about 465K characters of English prose and Python code
(the text behind `help()`). `corpus_texts()` splits it into paragraphs; `corpus_tokenizer()` trains a
byte-level BPE tokenizer on it once with the `tokenizers` library and caches it as a regular
`PreTrainedTokenizerFast` folder, which `AutoTokenizer.from_pretrained` reloads. `write_corpus_files(dir)` (or
`python -m hf_llmkit.data.corpus DIR`) writes it as a folder of .txt files, a `--dataset_dir` like the seed recipe's.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from hf_llmkit.data.cache import publish_once, remove_stale_temporaries

__all__ = ["corpus_texts", "corpus_tokenizer", "default_cache_dir", "write_corpus_files"]

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
DEFAULT_VOCAB_SIZE = 4096


def corpus_texts(*, min_chars: int = 40) -> list[str]:
    """Paragraphs of the embedded corpus, in a fixed order (deterministic across runs and machines)."""
    from pydoc_data.topics import topics

    texts = []
    for key in sorted(topics):
        for paragraph in topics[key].split("\n\n"):
            paragraph = paragraph.strip()
            if len(paragraph) >= min_chars:
                texts.append(paragraph)
    return texts


def default_cache_dir() -> Path:
    """Where built artefacts are cached: `$HF_LLMKIT_CACHE`, else `$XDG_CACHE_HOME/hf_llmkit`, else `~/.cache`."""
    root = os.environ.get("HF_LLMKIT_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf_llmkit"


def corpus_tokenizer(
    *, vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir: str | os.PathLike | None = None
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the embedded corpus, built once and cached on disk.

    The cache key includes the corpus content and vocab size, so a different Python version (different
    corpus) builds its own tokenizer instead of reusing a mismatched one.
    """
    if vocab_size < 300:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE (256 bytes + specials); use >= 300"
        )
    texts = corpus_texts()
    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:12]
    folder = Path(cache_dir or default_cache_dir()) / "tokenizers" / f"pydoc-bpe-{vocab_size}-{digest}"
    if (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer = _train_bpe(texts, vocab_size)
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(folder.parent)  # what a killed build left behind
    publish_once(folder, tokenizer.save_pretrained)
    return PreTrainedTokenizerFast.from_pretrained(folder)


def _train_bpe(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS, UNK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, model_max_length=2048
    )


def write_corpus_files(folder: str | os.PathLike, *, files: int = 8) -> list[Path]:
    """The embedded corpus as `files` UTF-8 .txt files of whole paragraphs (a `--dataset_dir` for examples)."""
    if files < 1:
        raise ValueError(f"files={files} must be at least 1")
    texts = corpus_texts()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(files):
        path = folder / f"corpus-{index:03d}.txt"
        path.write_text("\n".join(texts[index::files]) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


if __name__ == "__main__":  # python -m hf_llmkit.data.corpus DIR [FILES]: write the corpus as a folder of .txt files
    import sys

    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m hf_llmkit.data.corpus DIR [FILES]  (writes the embedded corpus as .txt files)")
    written = write_corpus_files(sys.argv[1], files=int(sys.argv[2]) if len(sys.argv) == 3 else 8)
    print(f"wrote {len(written)} files to {sys.argv[1]}")
