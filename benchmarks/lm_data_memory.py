"""Peak resident memory of tokenizing a single-line text file into cached blocks, as the main jobs do.

Each size runs in a fresh process: it writes one line of SIZE megabytes (the embedded corpus repeated, newlines
made spaces), then `hf_llmkit.data.blocks.build_lm_datasets` (block size 128, the corpus tokenizer, a cache folder, the
5% seeded split) tokenizes it. Reported per size: the peak resident memory (`ru_maxrss`: the process's own memory
and the mapped pages of files, what reading data through a memory map leaves resident included), what the build
added to it over the imports and the tokenizer, the build's seconds and megabytes of text per second. The files are
written to a temporary folder (about 7 times the text's size at the peak: the text, the blocks, the two splits) and
deleted.

No peer runs: the target is absolute (issue 21: a 1 GB single-line file within 2 GB resident memory), and the
recipe's pipeline (`datasets.map` over whole rows) holds a row's text and tokens in memory several times over: the
issue measured 7.6 GB at 50 MB and an abort in the Rust tokenizer at 200 MB.

    python benchmarks/lm_data_memory.py                  # 64 MB and 1024 MB (about 10 minutes on an idle core)
    python benchmarks/lm_data_memory.py --sizes 16 256   # other sizes, in megabytes
    python benchmarks/lm_data_memory.py --quick          # 1 MB: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.common import add_device_argument, markdown_table, pick_device, write_results

BLOCK_SIZE = 128


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(size_mb: float, workdir: Path) -> dict:
    """One measurement, in this (fresh) process; the cache folder is workdir/cache. (tests/data/test_blocks.py runs it
    too: `python benchmarks/lm_data_memory.py --child SIZE_MB WORKDIR` prints the result as one JSON line.)"""
    from hf_llmkit.data.blocks import build_lm_datasets
    from hf_llmkit.data.corpus import corpus_texts, corpus_tokenizer
    from hf_llmkit.data.files import TextFiles

    workdir.mkdir(parents=True, exist_ok=True)
    path, text = workdir / "one-line.txt", " ".join(corpus_texts()).replace("\n", " ").encode()
    with open(path, "wb") as handle:
        left = int(size_mb * (1 << 20))
        while left > 0:
            handle.write(text[:left])
            left -= len(text)
    tokenizer = corpus_tokenizer()
    before, start = _peak_mb(), time.perf_counter()
    data = build_lm_datasets(
        tokenizer=tokenizer, block_size=BLOCK_SIZE, texts=TextFiles([path]), cache_dir=workdir / "cache", seed=0
    )
    seconds = time.perf_counter() - start
    return {
        "size_mb": size_mb,
        "blocks": len(data["train"]) + len(data["validation"]),
        "peak_rss_mb": round(_peak_mb(), 1),
        "baseline_mb": round(before, 1),
        "added_mb": round(_peak_mb() - before, 1),
        "seconds": round(seconds, 1),
        "mb_per_s": round(size_mb / seconds, 2),
    }


def measure(size_mb: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="lm_data_memory_") as work:
        command = [sys.executable, __file__, "--child", str(size_mb), work]
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"the {size_mb:g} MB run failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[64, 1024], help="megabytes of text, one run each")
    parser.add_argument("--quick", action="store_true", help="1 MB only")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    add_device_argument(parser)  # tokenization runs on the CPU whatever the device
    options = parser.parse_args()
    if options.child:
        print(json.dumps(child(float(options.child[0]), Path(options.child[1]))))
        return
    pick_device(options.device)
    sizes = [1.0] if options.quick else options.sizes
    runs = [measure(size) for size in sizes]
    rows = [["text MB", "blocks", "peak RSS MB", "added by the build MB", "seconds", "MB/s"]]
    for run in runs:
        rows.append([f"{run['size_mb']:g}", str(run["blocks"]), f"{run['peak_rss_mb']:.0f}", f"{run['added_mb']:.0f}",
                     f"{run['seconds']:.0f}", f"{run['mb_per_s']:.2f}"])  # fmt: skip
    print(f"## single-line text tokenized into blocks of {BLOCK_SIZE} ({os.cpu_count()} cores)\n")
    print(markdown_table(rows))
    path = write_results("lm_data_memory", {"block_size": BLOCK_SIZE, "runs": runs})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
