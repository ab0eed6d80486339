"""Summaries, verdicts, tables and the plot of benchmarks/dkm_inference.py (the docs fragment renders the same table
from the results file through `table`)."""

from __future__ import annotations

import statistics
from pathlib import Path

from _common import markdown_table

BASE = "dense bf16"
MIB = 2**20


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(v for run in runs for v in (run[key] if isinstance(run[key], list) else [run[key]]))


def summarize(size: dict) -> None:
    """Adds `summary` to every threads cell of a size: per variant the medians, memory and per-round ratios to
    dense bf16 (its tokens/s over bf16's of the same round; prefill seconds over bf16's)."""
    for cell in size["threads"].values():
        runs, summary = cell["runs"], {}
        base = runs[BASE]
        for name, got in runs.items():
            ok = [r for r in got if "error" not in r]
            if not ok:
                summary[name] = {"error": got[0]["error"]}
                continue
            pairs = [(r, b) for r, b in zip(got, base) if "error" not in r]
            speed = [
                statistics.median(r["tokens_per_s_b1"]) / statistics.median(b["tokens_per_s_b1"]) for r, b in pairs
            ]
            speed8 = [
                statistics.median(r["tokens_per_s_b8"]) / statistics.median(b["tokens_per_s_b8"]) for r, b in pairs
            ]
            prefill = [
                statistics.median(r["times"]["prefill"]) / statistics.median(b["times"]["prefill"]) for r, b in pairs
            ]
            summary[name] = {
                "tokens_per_s_b1": _median(ok, "tokens_per_s_b1"),
                "tokens_per_s_b8": _median(ok, "tokens_per_s_b8"),
                "prefill_s": statistics.median(t for r in ok for t in r["times"]["prefill"]),
                "b1_x_bf16": statistics.median(speed),
                "b1_x_bf16_range": [min(speed), max(speed)],
                "b8_x_bf16": statistics.median(speed8),
                "prefill_x_bf16": statistics.median(prefill),
                "weight_bytes": ok[0]["weight_bytes"],
                "decoder_weight_bytes": ok[0]["decoder_weight_bytes"],
                "peak_rss_mib": max(r["peak_rss_mib"] for r in ok),
                "peak_load_over_base_mib": max(r["peak_rss_load_mib"] - r["rss_base_mib"] for r in ok),
                "peak_inference_over_base_mib": max(
                    (r["peak_rss_inference_mib"] or r["peak_rss_mib"]) - r["rss_base_mib"] for r in ok
                ),
                "load_s": statistics.median(r["load_s"] for r in ok),
                "module": ok[0]["modules"],
                "dkm_paths": sorted({p for r in ok for p in r.get("dkm_paths", [])}),  # how our layers multiplied
                "rounds": len(ok),
            }
        for s in summary.values():
            if "error" not in s:
                s["decoder_weights_x_bf16"] = s["decoder_weight_bytes"] / summary[BASE]["decoder_weight_bytes"]
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
            s = cell["summary"]
            mine = {n: v for n, v in s.items() if n.startswith("ours") and "error" not in v}
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
                    and "error" not in v
                    and _bits(n, size["specs"]) == bits
                }
                if not ours_b or not peers:
                    lines.append(f"{where} {bits}-bit: no {'peer' if ours_b else 'ours'} ran at {bits} bits")
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
            "layer",
        ]
    ]
    reasons = []
    for name, v in size["threads"][threads]["summary"].items():
        label = f"**{name}**" if name.startswith("ours") else name
        if "error" in v:
            rows.append([label, "did not run (below)", *[""] * 10])
            reasons.append(f"- {name}: {v['error']}")
            continue
        peak = f"{v['peak_load_over_base_mib']:,.0f} / {v['peak_inference_over_base_mib']:,.0f}"
        rows.append(
            [
                label,
                f"{v['tokens_per_s_b1']:.2f}",
                f"{v['b1_x_bf16']:.2f}",
                f"{v['tokens_per_s_b8']:.2f}",
                f"{v['b8_x_bf16']:.2f}",
                f"{v['prefill_s']:.3f}",
                f"{v['prefill_x_bf16']:.2f}",
                f"{v['decoder_weight_bytes'] / MIB:,.1f}",
                f"{v['decoder_weights_x_bf16']:.3f}",
                f"{v['weight_bytes'] / MIB:,.1f}",
                peak,
                v["module"] + (f" ({', '.join(v['dkm_paths'])} path)" if v.get("dkm_paths") else ""),
            ]
        )
    for name, why in size.get("not_run", {}).items():
        rows.append([name, "not run (below)", *[""] * 10])
        reasons.append(f"- {name}: {why}")
    return markdown_table(rows) + ("\n\nWhy a variant did not run:\n\n" + "\n".join(reasons) if reasons else "")


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
    from _common import save_figure

    sizes = list(results["sizes"].items())
    fig, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes), 5), squeeze=False)
    for ax, (name, size) in zip(axes[0], sizes):
        threads = next(iter(size["threads"]))
        for variant, v in size["threads"][threads]["summary"].items():
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
