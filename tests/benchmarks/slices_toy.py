"""A toy benchmark on the shared harness of benchmarks/slices.py, run by tests/benchmarks/test_slices.py as a real
benchmark is run: four variants in rotated rounds, each row a fresh process (a fork) that works a moment and writes
its result, every row saved to `results/toy.json` as it is measured, `--only-missing` to resume. One variant,
`crasher`, is the one the test names in $HF_LLMKIT_BENCH_CRASH. Prints the rows it will measure, then one line per
row as it starts it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from harness import slices  # noqa: E402

NAMES = ["alpha", "beta", "crasher", "gamma"]


def work(name: str, out: str) -> None:
    time.sleep(float(os.environ.get("TOY_SECONDS", "0.5")))
    Path(out).write_text(json.dumps({"value": len(name), "pid": os.getpid()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True, help="a folder for the rows' result files")
    parser.add_argument("--rounds", type=int, default=3)
    slices.add_only_missing_argument(parser)
    args = parser.parse_args()
    stored = slices.read_results("toy").get("runs", {}) if args.only_missing else None
    print("to measure: " + json.dumps(slices.to_measure(NAMES, args.rounds, stored)), flush=True)

    def measure(name: str, r: int) -> dict:
        print(f"measuring {name} round {r + 1}", flush=True)
        return slices.run_child(work, (name,), Path(args.work) / f"{name}-{r}.json", name=name, timeout=60)

    def save(name: str, r: int, runs: dict) -> None:
        slices.update_results("toy", {("runs",): runs})

    slices.measure_rounds(NAMES, args.rounds, measure, stored=stored, on_row=save)
    print("done", flush=True)


if __name__ == "__main__":
    main()
