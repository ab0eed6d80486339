"""The docs fragments of `dkm.py` (speed and memory against coremltools) and `dkm_quality.py` (quality per bit,
the main job's time); its real-model and soft-assignment sections render in `real_report` and `soft_report`.
"""

from __future__ import annotations

import statistics

from harness.common import markdown_table
from harness.registry import fragment, measured

# -- DKM ----------------------------------------------------------------------------------------------------------


@fragment("dkm_speed", "dkm")
def dkm_speed(results: dict) -> str:
    """Section (a) + (b) of benchmarks/dkm.py: one training step of one Linear against coremltools' DKMPalettizer."""
    data = results["dkm"]
    rows = [["layer", "bits", "coremltools s/step", "ours fp32: speed-up", "fp32 saved MiB: peer / ours",
             "ours bf16: speed-up", "init s: ours fp32 / coremltools"]]  # fmt: skip
    for r in data["speed"]:
        sliced = f" ({r['peer_rows']}-row slice)" if r["scale"] != 1 else ""
        peer = f"{statistics.median(r['peer_seconds']):.3g}{sliced}"
        speed = lambda o: f"{o['speedup_min']:.1f}x / {o['speedup_median']:.1f}x"  # noqa: E731
        fp32 = r["fp32"]
        saved = f"{r['peer_saved'] / 2**20:,.0f} / {fp32['saved'] / 2**20:,.2f} ({fp32['memory_ratio']:,.0f}x)"
        init = f"{r['fp32']['init']:.2f} / {r['peer_init']:.1f}"
        rows.append([r["layer"], str(r["bits"]), peer, speed(r["fp32"]), saved, speed(r["bf16"]), init])
    head = (
        "One training step (forward and backward of the clustering, 16 tokens, 3 iterations) against coremltools' "
        "`DKMPalettizer`; speed-ups are min / median of per-round ratios; a peer that ran on a slice of rows is "
        "scaled to the whole layer (its tensors are all row-shaped); its init is on the rows it ran.\n\n"
    )
    return head + markdown_table(rows) + "\n\n" + measured(data, "1 torch thread")


def _dkm_verdict(name: str, metrics: list[str], rows: list[dict]) -> list[str]:
    """Per index width: our best DKM row (trained, or refit and calibrated without training; not plain k-means) against
    the best peer storing no more bits per weight, and against the best peer of the same index width (whatever its
    scales cost), metric by metric."""
    lines = []
    for bits in (2, 3, 4):
        same = [r for r in rows if r.get("bits") == bits and "error" not in r]
        ours = [r for r in same if "(ours)" in r["method"] and (r.get("trained") or "calibrated" in r["method"])]
        if not ours:
            continue
        parts = []
        for m in metrics:
            lower = m in ("ppl", "worst_block_ratio")
            pick = min if lower else max
            best = pick(ours, key=lambda r: r[m])
            cheap = [r for r in rows if "(ours)" not in r["method"] and "error" not in r and r.get("bits") != 32
                     and r["bpw"] <= best["bpw"] + 0.01]  # fmt: skip
            wide = [r for r in same if "(ours)" not in r["method"]]
            said = []
            for label, group in (("at no more bits", cheap), (f"any {bits}-bit peer", wide)):
                if group:
                    peer = pick(group, key=lambda r: r[m])
                    ahead = best[m] < peer[m] if lower else best[m] > peer[m]
                    said.append(f"{label} {peer[m]:.4g} ({peer['method']}, {peer['bpw']:.2f}) "
                                f"{'behind us' if ahead else 'ahead of us'}")  # fmt: skip
            parts.append(f"{m} {best[m]:.4g}: " + ", ".join(said))
        lines.append(f"- {name}, DKM {bits}-bit: " + "; ".join(parts))
        lines += _training_verdict(name, bits, metrics, same)
    return lines


def _training_verdict(name: str, bits: int, metrics: list[str], rows: list[dict]) -> list[str]:
    """Whether training from the best post-training state (recipe='calibrated') improves on that start, per metric."""
    start = next((r for r in rows if "refit + calibrated, no training (ours)" in r["method"]), None)
    trained = next((r for r in rows if "recipe='calibrated'" in r["method"]), None)
    if start is None or trained is None:
        return []
    parts, better = [], []
    for m in metrics:
        up = trained[m] < start[m] if m in ("ppl", "worst_block_ratio") else trained[m] > start[m]
        better.append(up)
        parts.append(f"{m} {start[m]:.4g} -> {trained[m]:.4g}")
    verdict = "improves on" if all(better) else "improves on part of" if any(better) else "does NOT improve on"
    return [f"- {name}, DKM {bits}-bit: training from the calibrated start {verdict} it: " + ", ".join(parts)]


def _seed_spread(data: dict) -> str:
    """The rows measured again with another seed (`--seed`): each beside its seed-0 value, and per width whether our
    trained row (recipe='calibrated') beats every peer by more than the two seeds' spread."""
    parts = []
    for name, runs in data.get("seeds", {}).items():
        main = {r["method"]: r for r in data["workloads"].get(name, {}).get("rows", []) if "error" not in r}
        for seed, run in runs.items():
            metrics = list(run["metrics"])
            same = [(main[r["method"]], r) for r in run["rows"] if r["method"] in main and "error" not in r
                    and r.get("bits") != 32]  # fmt: skip
            if not same:
                continue
            table = [["method", "bits/weight", *(f"{m}: seed 0 / seed {seed}" for m in metrics)]]
            for a, b in same:
                method = f"**{a['method']}**" if "(ours)" in a["method"] else a["method"]
                table.append([method, f"{a['bpw']:.2f}", *(f"{a[m]:.4f} / {b[m]:.4f}" for m in metrics)])
            lines = []
            for bits in sorted({a["bits"] for a, _ in same}):
                ours = next(((a, b) for a, b in same if a["bits"] == bits and "recipe='calibrated'" in a["method"]),
                            None)  # fmt: skip
                rivals = [(a, b) for a, b in same if a["bits"] == bits and "(ours)" not in a["method"]]
                if ours is None or not rivals:
                    continue
                said = []
                for m in metrics:
                    sign = -1 if m in ("ppl", "worst_block_ratio") else 1  # margins are positive when we are ahead
                    margin = min(sign * (ours[i][m] - max(rivals, key=lambda r: sign * r[i][m])[i][m]) for i in (0, 1))
                    spread = max(abs(a[m] - b[m]) for a, b in [ours, *rivals])
                    verdict = "larger than" if margin > spread else "NOT larger than"
                    said.append(f"{m} margin {margin:.4f} over the best peer at either seed, {verdict} the largest "
                                f"seed-to-seed spread {spread:.4f}")  # fmt: skip
                lines.append(f"- {name}, {bits}-bit, trained from the calibrated start: " + "; ".join(said))
            when = run.get("measured")
            when = f" (`{when['command']}`, {when['date']})" if when else ""
            parts.append(f"**{name}**, seed 0 (the table above) against seed {seed}{when}: another order of the "
                         "training data and other calibration samples:\n\n" + markdown_table(table)
                         + ("\n\n" + "\n".join(lines) if lines else ""))  # fmt: skip
    return "\n\n".join(parts)


@fragment("dkm_quality", "dkm_quality")
def dkm_quality(results: dict) -> str:
    """benchmarks/dkm_quality.py: quality per bit against real peers on two workloads, and the step-time ratio."""
    data = results["dkm_quality"]
    out, verdict = [], []
    for name, w in data["workloads"].items():
        metrics = list(w["metrics"])
        rows = [["method", "bits/weight", *metrics, "compute s", "peak MiB"]]
        for r in w["rows"]:
            method = f"**{r['method']}**" if "(ours)" in r["method"] else r["method"]
            if "error" in r:
                rows.append([method, "-", *(["-"] * len(metrics)), "-", f"did not run: {r['error'][:80]}"])
                continue
            values = [f"{r[m]:.2f}" if m == "ppl" else f"{r[m]:.4f}" for m in metrics]
            rows.append([method, f"{r['bpw']:.2f}", *values, f"{r.get('seconds', 0):.0f}",
                         f"{r['peak_mb']:.0f}" if "peak_mb" in r else "-"])  # fmt: skip
        where = f", recipe `{w['recipe']}`" if "recipe" in w else ""
        when = w.get("measured")
        when = f"\n\nThese rows: {when['date']}, `{when['command']}`." if when else ""
        out.append(f"**{name}**{where}:\n\n" + markdown_table(rows) + when)
        jobs = [r["command"] for r in w["rows"] if "command" in r and "error" not in r]
        if jobs:
            out.append("The `run_clm.py` rows ran the main job on the pretrained checkpoint and reloaded what it "
                       "saved:\n" + "\n".join(f"`{job}`" for job in jobs))  # fmt: skip
        verdict += _dkm_verdict(name, metrics, w["rows"])
    head = (
        f"Every trained method: the same {data['steps']} AdamW steps (learning rate {data['lr']:g}) of distillation "
        f"from the fp32 model on the same batches{', dropout off' if data.get('dropout') == 0 else ''}. "
        "Bits per weight over the quantized matrices, tables, scales and "
        "zero points included (peers' scales and zeros at 16 bits, our tables at the width they are saved in: 32 "
        "bits, 16 for the rows with 16-bit tables)."
    )
    if "calibration_samples" in data:
        head += (
            f" The calibrated methods (GPTQ, ours) see the first {data['calibration_samples']} training sentences "
            "(MiniLM) or blocks (the causal LM)."
        )
    head += "\n\n"
    text = head + "\n\n".join(out)
    if verdict:
        text += "\n\nOur best DKM row (trained, or refit and calibrated) against the best peer (bits per weight in "
        text += "brackets):\n\n"
        text += "\n".join(verdict)
    seeds = _seed_spread(data)
    if seeds:
        text += "\n\n" + seeds
    return text + "\n\n" + measured(data)


@fragment("dkm_job", "dkm_quality")
def dkm_job(results: dict) -> str:
    """benchmarks/dkm_quality.py --only job: where the main job's time goes at Llama shapes, DKM against full
    fine-tuning (benchmarks/areas/dkm/job.py)."""
    data = results["dkm_quality"].get("job_times")
    if not data:
        return "Not measured yet: `python benchmarks/dkm_quality.py --only job`."
    rows = [["shape (parameters)", "job", "wall s", "model build s (k-means s)", "2 steps s", "2 evaluations s",
             "final save s", "the rest s", "peak RSS GiB", "wall x full fine-tuning"]]  # fmt: skip
    plain = {r["shape"]: r for r in data["rows"] if "error" not in r and not r["method"].startswith("DKM")}
    for r in data["rows"]:
        if "error" in r:
            rows.append([r["shape"], r["method"], *["-"] * 7, f"did not run: {r['error'][:80]}"])
            continue
        base = plain.get(r["shape"])
        ratio = f"{r['wall_s'] / base['wall_s']:.2f}" if base else "-"
        rows.append([f"{r['shape']} ({r['parameters'] / 1e6:,.0f}M)", r["method"], f"{r['wall_s']:.0f}",
                     f"{r['build']:.1f} ({r['kmeans']:.1f})", f"{r['train']:.1f}", f"{r['evaluate']:.1f}",
                     f"{r['save']:.1f}", f"{r['other_s']:.1f}", f"{r['peak_rss_mb'] / 1024:.1f}", ratio])  # fmt: skip
    return (
        "`python examples/run_clm.py` on a Llama shape built from scratch (bf16 weights and autocast, batch 1 x 128 "
        "tokens, 2 steps, `--save_strategy no`; its evaluations before and after training and its final save "
        "included), each job in a fresh process; the rest is the interpreter's start, the imports and the cached "
        "tokenized data:\n\n" + markdown_table(rows) + "\n\n" + measured({"recorded": data["measured"]})
    )  # the section's own record: a later run of another section rewrites the file's
