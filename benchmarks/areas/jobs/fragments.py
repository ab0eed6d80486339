"""The docs fragments of the whole jobs: CI's wall time (`ci_time.py`), `make quickstart` against the plain
`Trainer` (`quickstart.py`), tokenization memory (`lm_data_memory.py`) and the callbacks' cost (`callbacks.py`).
"""

from __future__ import annotations

import statistics

from harness.common import markdown_table
from harness.registry import fragment, measured, pair


def minutes(seconds: float) -> str:
    """`m:ss`, rounded to the second first (1259.84 s is 21:00, not 20:60)."""
    whole = round(seconds)
    return f"{whole // 60}:{whole % 60:02d}"


# -- CI and the quickstart ---------------------------------------------------------------------------------------


@fragment("ci", "ci")
def ci(results: dict) -> str:
    run = results["ci"]
    pytest = run["pytest"] or {"counts": {}, "seconds": 0.0}
    counts = ", ".join(f"{n} {kind}" for kind, n in pytest["counts"].items())
    status = "passed" if run["passed"] else f"FAILED (exit code {run['returncode']})"
    stages = "".join(f", `{name}` {minutes(seconds)}" for name, seconds in run.get("stages_s", {}).items())
    torch = " / ".join(v["torch"] for v in run.get("versions", []) if "torch" in v)
    return (
        f"CI from a fresh clone (`bash .ci/run` at {run['commit'][:7]}: a new virtual environment, empty caches) "
        f"{status} in {run['total_s'] / 60:.1f} minutes{stages}: install {run['install_s']} s, "
        f"ruff {run['ruff_s']} s, pytest {minutes(pytest['seconds'])} ({counts})"
        + (f"; torch {torch}" if torch else "")
        + ".\n\n"
        + measured(run, loads_itself=True)
    )


@fragment("quickstart", "quickstart")
def quickstart(results: dict) -> str:
    data = results["quickstart"]
    rows = [["variant", "process wall s (min / median)", "train s (min / median)", "train time x plain Trainer"]]
    for name, got in data["summary"].items():
        rows.append([name, pair(got["wall_s"], 1), pair(got["train_s"], 1), pair(got["train_ratio_to_peer"], 3)])
    rounds = len(next(iter(data["summary"].values()))["wall_s"])
    head = f"{data['steps']} steps, {rounds} round(s), each variant a fresh process, order rotated each round.\n\n"
    return head + markdown_table(rows) + "\n\n" + measured(data, f"{data['before']['torch_threads']} torch threads")


@fragment("quickstart_time", "quickstart")
def quickstart_time(results: dict) -> str:
    data = results["quickstart"]
    ours = data["summary"]["run_clm (make quickstart)"]
    return (
        f"`make quickstart` (environment installed) runs for {statistics.median(ours['wall_s']):.0f} s, "
        f"{statistics.median(ours['train_s']):.0f} s of it training {data['steps']} steps, "
        f"{pair(ours['train_ratio_to_peer'])} (min / median) times the training time of the same run on the plain "
        f"transformers `Trainer`.\n\n" + measured(data)
    )


@fragment("lm_data_memory", "lm_data_memory")
def lm_data_memory(results: dict) -> str:
    data = results["lm_data_memory"]
    runs = [
        f"{r['size_mb']:g} MB in {r['seconds']:.0f} s at a peak resident memory of {r['peak_rss_mb']:.0f} MB, "
        f"{r['added_mb']:.0f} MB over the imports and the tokenizer"
        for r in data["runs"]
    ]
    return (
        f"A text of one line, tokenized into blocks of {data['block_size']} tokens with a cache folder (a fresh "
        f"process per size): {'; '.join(runs)}.\n\n" + measured(data)
    )


# -- callbacks ----------------------------------------------------------------------------------------------------


@fragment("callbacks_overhead", "callbacks")
def callbacks_overhead(results: dict) -> str:
    data = results["callbacks"]
    rows = [["callback", "fastest step ms", "callback us per step", "overhead %"]]
    for name, row in data["overhead"]["callbacks"].items():
        cost = f"{row['callback_us_per_step']:.1f}"
        rows.append([name, f"{row['step_ms']:.1f}", cost, f"{row['overhead_pct']:.3f}"])
    e2e = data["overhead"]["end_to_end"]
    tail = (
        f"\n\nEnd to end, interleaved runs (fastest step, median of rounds): no callbacks {e2e['none_ms']:.1f} ms, "
        f"all three {e2e['all_three_ms']:.1f} ms, ratio {e2e['ratio']:.3f}."
    )
    threads = f"{data['machine'][0]['torch_threads']} torch threads"
    return markdown_table(rows) + tail + "\n\n" + measured(data, threads)


@fragment("callbacks_checkpoint", "callbacks")
def callbacks_checkpoint(results: dict) -> str:
    data = results["callbacks"]
    ckpt = data["checkpoint"]
    rows = [["save", "median s", "x plain Trainer save"]]
    for name, row in ckpt["rows"].items():
        rows.append([name, f"{row['seconds']:.3f}", f"{row['ratio_vs_peer']:.2f}"])
    head = f"A {ckpt['checkpoint_mb']:.1f} MiB checkpoint (model, optimizer, scheduler, RNG), median of saves:\n\n"
    return head + markdown_table(rows) + "\n\n" + measured(data)
