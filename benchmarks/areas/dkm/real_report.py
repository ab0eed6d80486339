"""The docs fragments of dkm_quality.py's real-model sections (`areas/dkm/real.py`): the SmolLM2 table with its
verdicts against the issue's targets, the seed spread, and the calibration cost; registered in
`harness/registry.py` (`areas/catalog.py` imports this module)."""

from __future__ import annotations

import statistics

from harness.common import markdown_table
from harness.registry import fragment, measured

LOWER = ("ppl", "kl", "worst_block_ratio")
TARGET_BITS = (2, 3)  # the fair test: the source's Q4_1 grid favours group-32 affine formats at 4 bits


def _better(metric: str, a: float, b: float) -> bool:
    return a < b if metric in LOWER else a > b


def _value(metric: str, value: float) -> str:
    return f"{value:.2f}" if metric == "ppl" else f"{value:.4f}"


def _ok(row: dict) -> bool:
    return "error" not in row and not row.get("reference") and row.get("bits") != 32


def _ours(row: dict) -> bool:
    return "(ours)" in row["method"]


# ours at 8 bits (`smollm2.cluster_embedding`): indices + a float32 table of 256 entries
EMBEDDING_BITS, EMBEDDING_TABLE = 8, 256


def whole_mb(section: dict, row: dict) -> str:
    """The whole model's weights in MB, the embedding as the row measured it / at 8 bits: a llama.cpp row from its
    files' tensors (its default file's embedding type named), any other from its decoder bits per weight, the tied
    embedding float32 / our 8-bit k-means, the other weights (norms) float32."""
    if "weights_mb" in row:
        default = f" / {row['default_file_mb']:.1f} ({row['default_embedding']})" if "default_file_mb" in row else ""
        return f"{row['weights_mb']:.1f} ({row['embedding']}){default}"
    total, decoder = section["parameters"], section["quantized_parameters"]
    embedding = section.get("embedding_parameters")
    if not embedding:
        return "-"
    rest = (total - decoder - embedding) * 32 + row["bpw"] * decoder
    at8 = embedding * EMBEDDING_BITS + EMBEDDING_TABLE * 32
    return f"{(rest + embedding * 32) / 8e6:.1f} / {(rest + at8) / 8e6:.1f}"


def table(section: dict) -> str:
    metrics = section["metrics"]
    rows = [["method", "bits/weight", *metrics, "whole model MB: embedding F32 / 8-bit", "CPU s (wall s)"]]
    for r in section["rows"]:
        method = f"**{r['method']}**" if _ours(r) else r["method"]
        if "error" in r:
            rows.append([method, "-", *(["-"] * (len(metrics) - 1)), f"did not run: {r['error'][:80]}", "-", "-"])
            continue
        types = r.get("types")
        if types:
            method += " [" + ", ".join(f"{n} {t}" for t, n in sorted(types.items())) + " matrices]"
        if r.get("same_file_as"):
            method += f" (the very file of {r['same_file_as'].split(' (')[0]})"
        size = whole_mb(section, r) if r["bits"] != 32 else "-"
        rows.append([method, f"{r['bpw']:.2f}", *(_value(m, r[m]) for m in metrics), size,
                     f"{r['cpu_s']:.0f} ({r['seconds']:.0f})" if "cpu_s" in r else "-"])  # fmt: skip
    return markdown_table(rows)


def _llamacpp(row: dict) -> bool:
    return row["method"].startswith("llama.cpp")


def verdicts(section: dict, seeds: dict) -> list[str]:
    """The issue's targets (51), each line saying whether it holds and by how much: at 2 and 3 bits our best row
    against every row with as many or more bits per weight below the next whole bit (a row with fewer bits named
    apart); at 4 bits against every llama.cpp format below 5 bits; each trained row of ours against its start."""
    rows = [r for r in section["rows"] if _ok(r)]
    lines = []
    for bits in (*TARGET_BITS, 4):
        ours = [r for r in rows if r["bits"] == bits and _ours(r)]
        if not ours:
            continue
        for m in ("kl", "ppl") if bits in TARGET_BITS else ("kl",):
            best = min(ours, key=lambda r: r[m]) if m in LOWER else max(ours, key=lambda r: r[m])
            if bits in TARGET_BITS:
                others = [r for r in rows if not _ours(r) and bits <= r["bpw"] < bits + 1]
                rivals = [r for r in others if r["bpw"] >= best["bpw"] - 0.005]
                cheaper = [r for r in others if r["bpw"] < best["bpw"] - 0.005]
                field = f"every row at {best['bpw']:.2f} to {bits + 1} bits/weight"
            else:
                rivals = [r for r in rows if _llamacpp(r) and r["bpw"] < 5]
                cheaper, field = [], "every llama.cpp format below 5 bits/weight"
            ahead = [r for r in rivals if not _better(m, best[m], r[m])]
            said = (f"{m} {_value(m, best[m])} ({best['method']}, {best['bpw']:.2f} bits/weight): "
                    + (f"NOT SHOWN: {field}: none measured yet" if not rivals else
                       f"lowest of {field}" if not ahead else
                       f"NOT the lowest of {field}: " + ", ".join(f"{r['method']} {_value(m, r[m])} ({r['bpw']:.2f})"
                                                                  for r in ahead)))  # fmt: skip
            if rivals and not ahead:
                nearest = min(rivals, key=lambda r: abs(r[m] - best[m]))
                said += f" (nearest: {nearest['method']} {_value(m, nearest[m])}, {nearest['bpw']:.2f})"
            margin = _seed_margin(section, seeds, bits, m, best) if bits in TARGET_BITS else ""
            if margin:
                said += f"; {margin}"
            for r in cheaper:
                said += (f"; with fewer bits: {r['method']} {_value(m, r[m])} ({r['bpw']:.2f}, "
                         f"{'behind' if _better(m, best[m], r[m]) else 'AHEAD OF'} us)")  # fmt: skip
            missing = _not_measured(section, bits)
            if missing:
                said += f"; NOT MEASURED YET (a verdict over the rows above only): {', '.join(missing)}"
            lines.append(f"- {bits}-bit, {said}")
    for bits in sorted({r["bits"] for r in rows}):
        start = next((r for r in rows if r["bits"] == bits and "no training (ours)" in r["method"]), None)
        for trained in (r for r in rows if r["bits"] == bits and r.get("trained") and _ours(r)):
            if start is None:
                continue
            moved = [(m, _better(m, trained[m], start[m])) for m in section["metrics"]]
            verdict = "improves on" if all(u for _, u in moved) else "does NOT improve on"
            parts = ", ".join(f"{m} {_value(m, start[m])} -> {_value(m, trained[m])}" for m, _ in moved)
            lines.append(f"- {bits}-bit, {trained['method']}: {verdict} its start on every metric: {parts}")
    return lines


def _not_measured(section: dict, bits: int) -> list[str]:
    """The rows a full run measures at `bits` (`real.planned_rows`) that the section holds nothing of (a row that
    could not run holds its reason)."""
    from areas.dkm import real

    held = {r["method"] for r in section["rows"]}
    return [name for name in real.planned_rows(bits) if name not in held]


def _seed_margin(section: dict, seeds: dict, bits: int, metric: str, best: dict) -> str:
    """Our best row's margin over the best peer, at either seed, against the largest seed-to-seed spread of the
    rows compared (a data-free peer gives the same model at every seed: no spread)."""
    if not seeds:
        return ""
    other = {r["method"]: r for run in seeds.values() for r in run["rows"] if "error" not in r}
    rows = [r for r in section["rows"] if _ok(r)]
    peers = [r for r in rows if not _ours(r) and best["bpw"] - 0.005 <= r["bpw"] < bits + 1]
    if best["method"] not in other or not peers:
        return ""
    pair = lambda r: (r[metric], other[r["method"]][metric] if r["method"] in other else r[metric])  # noqa: E731
    ours, rivals = pair(best), [pair(r) for r in peers]
    sign = -1 if metric in LOWER else 1
    margin = min(sign * (ours[i] - max(rivals, key=lambda v: sign * v[i])[i]) for i in (0, 1))
    spread = max(abs(a - b) for a, b in [ours, *rivals])
    word = "larger than" if margin > spread else "NOT larger than"
    return f"margin {margin:.4f} over the best such peer at either seed, {word} the seed-to-seed spread {spread:.4f}"


def _real_model(name: str, key: str, only: str):
    """Register `render(data, section)` as fragment `name` of dkm_quality.json's `key` section; while that section
    is missing the fragment says which command measures it."""

    def register(render):
        @fragment(name, "dkm_quality")
        def fragment_text(results: dict) -> str:
            data = results["dkm_quality"]
            if not data.get(key):
                return f"Not measured yet: `python benchmarks/dkm_quality.py --only {only}`.\n\n" + measured(data)
            return render(data, data[key])

        fragment_text.__doc__ = render.__doc__
        return fragment_text

    return register


@_real_model("dkm_smollm2", "real_model", "smollm2")
def dkm_smollm2(data: dict, section: dict) -> str:
    """dkm_quality.py --only smollm2: the real decoder LLM's quality per bit against every peer, and the targets."""
    split, (samples, tokens), (batch, window) = section["split"], section["calibration"], section["train_batch"]
    head = (
        f"{section['model']} ({section['parameters'] / 1e6:.1f}M parameters, {section['layers']} layers; every "
        f"method quantizes the decoder's {section['quantized_parameters'] / 1e6:.1f}M Linear weights, none the tied "
        f"embedding / LM head). Held out: the last {split['held_out_texts']} of the {split['texts']} pydoc topics "
        f"texts, {split['eval_tokens']:,} tokens in blocks of {section['block']}; calibration ({samples} windows of "
        f"{tokens} tokens) and training read only the {split['train_tokens']:,} tokens before them. Every trained "
        f"method: the same {section['steps']} AdamW steps (learning rate {section['lr']:g}; {batch} windows of "
        f"{window} tokens a step) of distillation from the source model on the same batches, the decoder's Linear "
        "layers trained, the embedding not. kl: KL(source || method) of the next-token distribution per token; top1: "
        "agreement with the source's most likely token; worst_block_ratio: the worst block's perplexity over the "
        "source's. CPU s: the seconds the method's quantization (and training) held a core, one torch thread; "
        "the wall time on the shared machine follows in brackets. Whole model MB: every weight the model holds, the "
        "tied embedding in float32 as measured / clustered at 8 bits (our k-means, the eDKM paper's treatment); for "
        "llama.cpp, its files' tensors: the measured file (its embedding's type in brackets) / llama.cpp's own "
        "default file of the format (its embedding type). llama.cpp's bits per weight are counted from the file's "
        "tensor types (its K-quants fall back on SmolLM2's 576-wide rows). The source's weights sit on Q4_1's grid "
        "(4 bits "
        "and an affine scale per 32 weights): at 4 bits "
        "a group-32 affine format can reproduce them, so the 4-bit rows favour such formats; 2 and 3 bits are the "
        "fair test.\n\n"
    )
    parts = [head + table(section)]
    tok = section.get("llama_cpp_tokenizer")
    if tok:
        same = "the same ids" if tok["identical"] else f"{tok['equal_ids']:,} of {tok['tokens']:,} ids equal"
        parts.append(f"llama.cpp ran on the held-out token ids themselves; its own tokenizer gives {same} for the "
                     "held-out text.")  # fmt: skip
    if section.get("embedding_rows"):
        rows = [["embedding / tied LM head", "decoder bits/weight", "embedding bits/weight", *section["metrics"]]]
        for r in section["embedding_rows"]:
            rows.append([r["method"], f"{r['bpw']:.2f}", f"{r['embedding_bpw']:.2f}",
                         *(_value(m, r[m]) for m in section["metrics"])])  # fmt: skip
        parts.append("The eDKM paper's 8-bit clustering of the embedding (tied: the LM head reads the same clustered "
                     "matrix):\n\n" + markdown_table(rows))  # fmt: skip
    seeds = data.get("real_model_seeds", {})
    for seed, run in seeds.items():
        main = {r["method"]: r for r in section["rows"] if "error" not in r}
        rows = [["method", "bits/weight", *(f"{m}: seed 0 / seed {seed}" for m in section["metrics"])]]
        for r in run["rows"]:
            if r["method"] in main and "error" not in r:
                a = main[r["method"]]
                rows.append([r["method"], f"{a['bpw']:.2f}",
                             *(f"{_value(m, a[m])} / {_value(m, r[m])}" for m in section["metrics"])])  # fmt: skip
        parts.append(f"Seed 0 against seed {seed} (other calibration windows and training batches; the data-free "
                     "methods give the same model at every seed):\n\n" + markdown_table(rows))  # fmt: skip
    lines = verdicts(section, seeds)
    if lines:
        parts.append("Against the targets (issues 43, 51):\n\n" + "\n".join(lines))
    runs = section.get("runs", [section["measured"]])
    parts.append("These rows: " + "; ".join(f"{r['date']}, `{r['command']}`" for r in runs) + ".")
    return "\n\n".join(parts) + "\n\n" + measured({"recorded": runs[-1]})


@_real_model("dkm_calibration_cost", "real_model_calibration", "calibration")
def dkm_calibration_cost(data: dict, cost: dict) -> str:
    """dkm_quality.py --only calibration: our calibrated start against llmcompressor's GPTQ, same model and samples."""
    rows = [["SmolLM2-135M, whole model", "wall s: min / median", "x GPTQ (min / median)", "CPU s: min / median",
             "x GPTQ (min / median)"]]  # fmt: skip
    cpu = cost["cpu_seconds"]
    for name, s in cost["summary"].items():
        ours = name == cost["ours"]
        cpu_ratio = f"{cost['cpu_ratio_min']:.2f} / {cost['cpu_ratio_median']:.2f}" if ours else "1.00 / 1.00"
        wall = f"{s['ratio_min']:.2f} / {s['ratio_median']:.2f}"
        rows.append([name, f"{s['min_s']:.0f} / {s['median_s']:.0f}", wall,
                     f"{min(cpu[name]):.0f} / {statistics.median(cpu[name]):.0f}", cpu_ratio])  # fmt: skip
    samples, tokens = cost["samples"]
    holds = "holds" if cost["cpu_ratio_median"] <= 1 and cost["ratio_median"] <= 1 else "does NOT hold"
    return (
        f"{cost['bits']}-bit, the same {samples} calibration windows of {tokens} tokens, a fresh model per run, "
        f"{len(next(iter(cost['seconds'].values())))} rounds in alternating order, {cost['torch_threads']} torch "
        "thread(s); CPU seconds are the process's own (on a shared machine they do not count the time other "
        f"processes held the cores):\n\n"
        + markdown_table(rows)
        + f"\n\n- target (issue 43): our calibrated start in no more time than GPTQ: {holds} (ours / GPTQ, min / "
        f"median: wall {cost['ratio_min']:.2f} / {cost['ratio_median']:.2f}, CPU {cost['cpu_ratio_min']:.2f} / "
        f"{cost['cpu_ratio_median']:.2f})\n\n" + measured({"recorded": cost["measured"]})
    )


@_real_model("dkm_recipe", "real_model_recipe", "recipe")
def dkm_recipe(data: dict, recipe: dict) -> str:
    """dkm_quality.py --only recipe: the whole path on the real model, each stage's wall time and peak RSS."""
    rows = [["stage", "wall s", "peak RSS GiB", "held-out response loss: before -> after", "what it left"]]
    sizes = recipe["folder_mb"]
    for stage in recipe["stages"]:
        if "error" in stage:
            rows.append([stage["stage"], "-", "-", "-", f"did not run: {stage['error'][:80]}"])
            continue
        losses = (f"{stage['eval_loss_before']:.3f} -> {stage['eval_loss']:.3f}" if "eval_loss_before" in stage
                  else "-")  # fmt: skip
        left = {
            "sft": f"merged plain model, {sizes['merged']:.0f} MiB" if sizes.get("merged") else "-",
            "dkm": f"compact checkpoint, {sizes['dkm']:.0f} MiB" if sizes.get("dkm") else "-",
            "generate": (f"{stage.get('packed_layers', 0)} packed layers, {stage.get('tokens_per_s', 0):.1f} new "
                         "tokens/s (greedy, batch 1)"),
            "export": f"ONNX file, {stage.get('onnx_mb', 0):.0f} MiB",
        }[stage["key"]]  # fmt: skip
        rows.append([stage["stage"], f"{stage['wall_s']:.0f}", f"{stage['peak_rss_mb'] / 1024:.2f}", losses, left])
    size = recipe["size"]
    text = next((s.get("text") for s in recipe["stages"] if s.get("key") == "generate" and "text" in s), None)
    shown = text.strip()[:200].replace("`", "'") if text else None
    said = f"\n\nIts answer after the path (greedy): `{shown}`" if shown else ""
    return (
        f"{recipe['model']}, {size['steps']} steps a job ({size['batch']} records of up to {size['length']} tokens "
        f"a step), {size['eval']} held-out records; the DKM job calibrates on {size['calibration']} records first. "
        "Each stage is a fresh process; the losses are the job's own on the held-out records' response tokens (the "
        "DKM job's 'before' is its calibrated start). The commands:\n\n"
        + "\n".join(f"`{command}`" for command in recipe["commands"].values())
        + "\n\n"
        + markdown_table(rows)
        + said
        + "\n\n"
        + measured({"recorded": recipe["measured"]})
    )
