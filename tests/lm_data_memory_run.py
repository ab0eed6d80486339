"""Run by tests/test_lm_data.py in a fresh interpreter: tokenize a single-line text file of SIZE_MB megabytes into
blocks (with a cache folder, as the main job does) and print the peak resident memory it added, as one JSON line.

    python tests/lm_data_memory_run.py WORKDIR SIZE_MB

`ru_maxrss` is the process's high-water mark of resident memory: its own (anonymous) memory and the pages of the files
it maps (data read through a memory map stays resident, and counts). Read once after the imports and the tokenizer,
once after the build.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

from hf_llmkit.corpus import corpus_texts, corpus_tokenizer
from hf_llmkit.data_files import TextFiles
from hf_llmkit.lm_data import build_lm_datasets


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    workdir, size_mb = Path(sys.argv[1]), float(sys.argv[2])
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"one-line-{size_mb:g}mb.txt"
    text = " ".join(corpus_texts()).replace("\n", " ").encode()
    with open(path, "wb") as handle:  # one line, written a piece at a time
        left = int(size_mb * (1 << 20))
        while left > 0:
            handle.write(text[:left])
            left -= len(text)
    tokenizer = corpus_tokenizer()
    before, start = _peak_mb(), time.perf_counter()
    data = build_lm_datasets(
        tokenizer=tokenizer, block_size=128, texts=TextFiles([path]), cache_dir=workdir / "cache", seed=0
    )
    result = {
        "added_mb": _peak_mb() - before,
        "baseline_mb": before,
        "blocks": len(data["train"]) + len(data["validation"]),
        "seconds": time.perf_counter() - start,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
