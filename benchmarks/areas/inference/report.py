"""Summaries, verdicts, tables and the plot of benchmarks/dkm_inference.py (the docs fragment renders the same table
from the results file through `table`)."""

from __future__ import annotations

import statistics
from pathlib import Path

from harness.common import markdown_table
from harness.slices import load_of, mark, no_verdict, usable

BASE = "dense bf16"
MIB = 2**20


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(v for run in runs for v in (run[key] if isinstance(run[key], list) else [run[key]]))


def _per_round(got: list[dict], base: list[dict], key: str, times: bool = False) -> list[float]:
    """Per-round ratios of a variant's median `key` to the base's of the same round (seconds: base over variant's
    inverse, so that every ratio reads "x as fast" for tokens/s and "x the time" for prefill)."""
    out = []
    for r, b in zip(got, base):
        if not r or not b or "error" in r or "error" in b:  # a row not measured (yet) or that did not run
            continue
        mine = r["times"][key] if times else r[key]
        theirs = b["times"][key] if times else b[key]
        out.append(statistics.median(mine) / statistics.median(theirs))
    return out


def summarize(size: dict, base: str = BASE) -> None:
    """Adds `summary` to every threads cell of a part: per variant the medians, memory, which loops multiplied and
    per-round ratios to `base` (its tokens/s over the base's of the same round; prefill seconds over the base's),
    and where measured the kernel's and the framework's milliseconds per generated token. Rows not measured yet (a
    part saved half way) are left out; a ratio without a base row of the same round is None; `loaded` (and the
    highest load) where a row was measured on a machine above its core count."""
    for cell in size["threads"].values():
        runs, summary = cell.get("runs", {}), {}
        for name, got in runs.items():
            ok = [r for r in got if r and "error" not in r]
            if not ok:
                failed = [r for r in got if r]
                if failed:
                    summary[name] = {"error": failed[0]["error"]}
                continue
            speed = _per_round(got, runs.get(base, []), "tokens_per_s_b1")
            prefill = _per_round(got, runs.get(base, []), "prefill", times=True)
            entry = {
                "tokens_per_s_b1": _median(ok, "tokens_per_s_b1"),
                "prefill_s": statistics.median(t for r in ok for t in r["times"]["prefill"]),
                "b1_x_bf16": statistics.median(speed) if speed else None,
                "b1_x_bf16_range": [min(speed), max(speed)] if speed else None,
                "prefill_x_bf16": statistics.median(prefill) if prefill else None,
                "weight_bytes": ok[0]["weight_bytes"],
                "decoder_weight_bytes": ok[0]["decoder_weight_bytes"],
                "load_s": statistics.median(r["load_s"] for r in ok),
                "module": ok[0]["modules"],
                "loops": ok[0].get("loops", ""),
                "dkm_paths": sorted({p for r in ok for p in r.get("dkm_paths", [])}),  # how our layers multiplied
                "first_tokens": ok[0].get("first_tokens"),
                "rounds": len(ok),
            }
            if all("tokens_per_s_b8" in r for r in ok):
                b8 = _per_round(got, runs.get(base, []), "tokens_per_s_b8")
                entry["tokens_per_s_b8"] = _median(ok, "tokens_per_s_b8")
                entry["b8_x_bf16"] = statistics.median(b8) if b8 else None
            if all("rss_base_mib" in r for r in ok):
                entry["peak_rss_mib"] = max(r["peak_rss_mib"] for r in ok)
                entry["peak_load_over_base_mib"] = max(r["peak_rss_load_mib"] - r["rss_base_mib"] for r in ok)
                entry["peak_inference_over_base_mib"] = max(
                    (r["peak_rss_inference_mib"] or r["peak_rss_mib"]) - r["rss_base_mib"] for r in ok
                )
            if all("perplexity" in r for r in ok):
                entry["perplexity"] = ok[0]["perplexity"]
            if all("kernel_s_per_token" in r for r in ok):  # kernel time, and the rest of each round's token time
                kernel = [statistics.median(r["kernel_s_per_token"]) * 1e3 for r in ok]
                token = [1e3 / statistics.median(r["tokens_per_s_b1"]) for r in ok]
                entry["kernel_ms_per_token"] = statistics.median(kernel)
                entry["framework_ms_per_token"] = statistics.median(t - k for t, k in zip(token, kernel))
            entry.update(load_of(ok))
            summary[name] = entry
        reference = summary.get(base, {"error": "not measured"})
        for s in summary.values():
            if "error" not in s and "error" not in reference:
                s["decoder_weights_x_bf16"] = s["decoder_weight_bytes"] / reference["decoder_weight_bytes"]
        cell["summary"] = summary


def _bits(name: str, specs: dict) -> int:
    return specs[name]["bits"]


def _says(holds: bool) -> str:
    return "holds" if holds else "FAILS"


def verdicts(results: dict) -> list[str]:
    """The issue's targets, one line each per size and thread count: ours at batch 1 >= dense bf16 with decoder
    weights <= 1/4 of bf16's, prefill within 1.5x of bf16, ours the fastest 3-bit format and within 10% of the fastest
    4-bit one (batch-1 tokens/s, medians)."""
    lines = []
    for size_name, size in results["sizes"].items():
        for threads, cell in size["threads"].items():
            where = f"[{size_name}, {threads} thread{'s' * (threads != '1')}]"
            s = cell.get("summary", {})
            lines += [f"{where} {no_verdict(n, v)}" for n, v in s.items() if v.get("loaded")]
            judged = ("b1_x_bf16", "prefill_x_bf16", "decoder_weights_x_bf16")  # None: no base row in its rounds
            mine = {
                n: v for n, v in s.items() if n.startswith("ours") and usable(v) and None not in map(v.get, judged)
            }
            if not usable(s.get(BASE)):  # every target is a ratio to dense bf16
                why = "measured on a loaded machine" if s.get(BASE, {}).get("loaded") else "did not run"
                lines += [
                    f"{where} {bits}-bit: no verdict ({BASE}, the base of every ratio, {why})" for bits in (3, 4)
                ]
                continue
            for name, v in mine.items():
                fast, small = _says(v["b1_x_bf16"] >= 1), _says(v["decoder_weights_x_bf16"] <= 0.25)
                pre = _says(v["prefill_x_bf16"] <= 1.5)
                lines.append(
                    f"{where} {name}: batch-1 tokens/s {v['b1_x_bf16']:.2f}x dense bf16 ({fast} >= 1), decoder "
                    f"weights {v['decoder_weights_x_bf16']:.3f}x bf16 ({small} <= 0.25), prefill "
                    f"{v['prefill_x_bf16']:.2f}x bf16 ({pre} <= 1.5)"
                )
            for bits in (3, 4):
                ours_b = {n: v for n, v in mine.items() if _bits(n, size["specs"]) == bits}
                peers = {
                    n: v
                    for n, v in s.items()
                    if not n.startswith(("ours", "dense", "onnxruntime"))
                    and usable(v)
                    and v.get("b1_x_bf16") is not None
                    and _bits(n, size["specs"]) == bits
                }
                if not ours_b or not peers:  # none ran, or each was measured on a loaded machine
                    lines.append(f"{where} {bits}-bit: no {'peer' if ours_b else 'ours'} row to judge at {bits} bits")
                    continue
                best = max(ours_b, key=lambda n: ours_b[n]["b1_x_bf16"])  # per-round ratios: the drift cancels
                peer = max(peers, key=lambda n: peers[n]["b1_x_bf16"])
                ratio = ours_b[best]["b1_x_bf16"] / peers[peer]["b1_x_bf16"]
                target = 1.0 if bits == 3 else 0.9
                what = "the fastest 3-bit format" if bits == 3 else "within 10% of the fastest 4-bit format"
                lines.append(
                    f"{where} {bits}-bit: ours {what}: {_says(ratio >= target)} (best: {best} "
                    f"{ours_b[best]['tokens_per_s_b1']:.1f} tokens/s, fastest peer {peer} "
                    f"{peers[peer]['tokens_per_s_b1']:.1f}: {ratio:.2f}x)"
                )
    return lines


def table(size: dict, threads: str) -> str:
    """Markdown: one row per variant (medians; ratios are per-round medians against dense bf16)."""
    rows = [
        [
            "variant",
            "tokens/s batch 1",
            "x bf16",
            "tokens/s batch 8",
            "x bf16",
            "prefill s",
            "x bf16",
            "decoder weights MiB",
            "x bf16",
            "whole model MiB",
            "peak RSS over imports MiB: load / inference",
            "layer; loops",
        ]
    ]
    reasons = []
    for name, v in size["threads"][threads].get("summary", {}).items():
        label = mark(f"**{name}**" if name.startswith("ours") else name, v)
        if "error" in v:
            rows.append([label, "did not run (below)", *[""] * 10])
            reasons.append(f"- {name}: {v['error']}")
            continue
        peak = f"{v['peak_load_over_base_mib']:,.0f} / {v['peak_inference_over_base_mib']:,.0f}"
        rows.append(
            [
                label,
                f"{v['tokens_per_s_b1']:.2f}",
                _fmt(v.get("b1_x_bf16"), ".2f"),
                _fmt(v.get("tokens_per_s_b8"), ".2f"),
                _fmt(v.get("b8_x_bf16"), ".2f"),
                f"{v['prefill_s']:.3f}",
                _fmt(v.get("prefill_x_bf16"), ".2f"),
                f"{v['decoder_weight_bytes'] / MIB:,.1f}",
                _fmt(v.get("decoder_weights_x_bf16"), ".3f"),
                f"{v['weight_bytes'] / MIB:,.1f}",
                peak,
                v["module"]
                + (f" ({', '.join(v['dkm_paths'])} path)" if v.get("dkm_paths") else "")
                + (f"; {v['loops']}" if v.get("loops") else ""),
            ]
        )
    for name, why in size.get("not_run", {}).items():
        rows.append([name, "not run (below)", *[""] * 10])
        reasons.append(f"- {name}: {why}")
    return markdown_table(rows) + ("\n\nWhy a variant did not run:\n\n" + "\n".join(reasons) if reasons else "")


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def heading(size_name: str, size: dict, threads: str, config: dict) -> str:
    shape = size["shape"]
    return (
        f"Llama hidden {shape['hidden']:,}, {shape['layers']} layers, MLP {shape['intermediate']:,}, vocabulary "
        f"{shape['vocab']:,} (random weights, bf16 checkpoint), {threads} torch thread(s): greedy `generate` of "
        f"{size['new_tokens']} new tokens after {config['prompt']} prompt tokens, prefill of {config['prefill']} "
        f"tokens; {size['rounds']} round(s), each variant a fresh process per round, order rotated."
    )


def print_tables(results: dict) -> None:
    for size_name, size in results["sizes"].items():
        for threads in size["threads"]:
            print(f"\n### {size_name}\n\n{heading(size_name, size, threads, results['config'])}\n")
            print(table(size, threads))


def plot(results: dict) -> Path | None:
    """Batch-1 tokens/s against decoder weight MiB, one panel per size (the first thread count)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from harness.common import save_figure

    sizes = list(results["sizes"].items())
    fig, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes), 5), squeeze=False)
    for ax, (name, size) in zip(axes[0], sizes):
        threads = next(iter(size["threads"]))
        for variant, v in size["threads"][threads].get("summary", {}).items():
            if "error" in v:
                continue
            ours = variant.startswith("ours")
            x, y = v["decoder_weight_bytes"] / MIB, v["tokens_per_s_b1"]
            ax.scatter(x, y, marker="*" if ours else "o", s=120 if ours else 50)
            ax.annotate(
                variant.replace("ours DKM ", "DKM "), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points"
            )
        ax.set_xscale("log")
        ax.set_xlabel("decoder-layer weights held in memory (MiB, log)")
        ax.set_ylabel("batch-1 generate tokens/s (higher is better)")
        ax.set_title(
            f"{name}: {size['shape']['hidden']} hidden, {size['shape']['layers']} layers, {threads} thread(s)",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
    return save_figure(fig, "dkm_inference")
