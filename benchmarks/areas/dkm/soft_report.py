"""The docs' tables of `benchmarks/results/dkm_soft.json`: the step cost of DKM's soft assignment (`dkm_steps`) and
soft assignment against straight-through training from the calibrated start (`dkm_soft`)."""

from __future__ import annotations

from harness.common import markdown_table
from harness.registry import fragment, measured

STEP_TARGETS = {"fp32": 2.0, "bf16": 1.3}  # issue 43: a soft-assignment step, x the plain float32 step
TARGET_ROWS = ("DKM 3-bit fp32", "DKM 4-bit fp32", "DKM 3-bit bf16", "DKM 4-bit bf16")
LOWER_IS_BETTER = ("kl", "ppl", "worst_block_ratio")
STRAIGHT = "straight-through (the recipe)"  # the study's baseline variant (`areas.dkm.soft.VARIANTS`)


def _when(section: dict) -> str:
    return f"{section['measured']['date']}, `{section['measured']['command']}`"


def _step_rows(name: str, data: dict) -> list[list[str]]:
    rows = []
    for label, s in data["summary"].items():
        ratio = f"{s['ratio_min']:.2f} / {s['ratio_median']:.2f}" if "ratio_min" in s else "-"
        saved = data.get("saved_mib", {}).get(label)
        rows.append([name, label, f"{s['min_s']:.3f}", f"{s['median_s']:.3f}", ratio,
                     "-" if saved is None else f"{saved:,.1f}"])  # fmt: skip
    return rows


def step_targets(steps: dict) -> list[str]:
    """Each target row of each workload against the issue's bound (medians of per-round ratios), and the kernel's
    saved-for-backward bytes against the torch ops'."""
    lines = []
    for name, data in steps["workloads"].items():
        summary, saved = data["summary"], data.get("saved_mib", {})
        for label in TARGET_ROWS:
            if label not in summary:
                continue
            bound = STEP_TARGETS[label.split()[-1]]
            med, low = summary[label]["ratio_median"], summary[label]["ratio_min"]
            verdict = "holds" if med <= bound else "FAILS"
            lines.append(f"[issue] {name}, {label}: {low:.2f} / {med:.2f} x the plain fp32 step (min / median; "
                         f"{verdict} <= {bound})")  # fmt: skip
        for kernel, ops in (("DKM 3-bit fp32", "DKM 3-bit fp32, torch ops (no kernel)"),
                            ("DKM 3-bit bf16", "DKM 3-bit bf16, torch ops (table engine)")):  # fmt: skip
            if kernel in saved and ops in saved:
                verdict = "holds" if saved[kernel] <= saved[ops] else "FAILS"
                lines.append(f"[issue] {name}, {kernel}: {saved[kernel]:,.1f} MiB saved for backward, the torch ops "
                             f"{saved[ops]:,.1f} ({verdict}: no more than before)")  # fmt: skip
    return lines


@fragment("dkm_steps", "dkm_soft")
def dkm_steps(results: dict) -> str:
    """`python benchmarks/dkm_quality.py --only steps`: one training step, plain against DKM, two real models."""
    steps = results["dkm_soft"].get("steps")
    if not steps:
        return "Not measured yet: `python benchmarks/dkm_quality.py --only steps`."
    head = [["model", "one training step", "min s", "median s", "x plain fp32 (min / median)", "saved MiB"]]
    rows = [r for name, data in steps["workloads"].items() for r in _step_rows(name, data)]
    text = (
        f"One training step, forward and backward (MiniLM's includes its teacher's forward), {steps['threads']} torch "
        f"thread(s), the interval kernel's `{steps['kernel_loops']}` loops; variants in interleaved rounds, ratios "
        "min / median of per-round ratios; saved: the bytes a step keeps for backward, each storage once, "
        "parameters left out:\n\n" + markdown_table(head + rows) + "\n\nThe targets:\n\n"
    )
    text += "\n".join(f"- {line}" for line in step_targets(steps))
    return text + f"\n\nThese rows: {_when(steps)}.\n\n" + measured({"recorded": steps["measured"]})


def _number(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
    return str(value)


def study_verdicts(study: dict) -> list[str]:
    """Per workload and width: the best soft variant against straight-through, metric by metric."""
    lines = []
    for name, data in study["workloads"].items():
        metrics = data["metrics"]
        for bits in sorted({r["bits"] for r in data["rows"]}):
            rows = [r for r in data["rows"] if r["bits"] == bits and "error" not in r]
            straight = next((r for r in rows if r["variant"] == STRAIGHT), None)
            soft = [r for r in rows if r["variant"].startswith("soft")]
            if straight is None or not soft:
                continue
            first = metrics[0]
            sign = 1 if first in LOWER_IS_BETTER else -1
            best = min(soft, key=lambda r: sign * r[first])
            wins = [m for m in metrics if (best[m] < straight[m]) == (m in LOWER_IS_BETTER)]
            parts = ", ".join(f"{m} {best[m]:.4g} vs {straight[m]:.4g}" for m in metrics)
            verdict = (
                "soft wins"
                if len(wins) == len(metrics)
                else ("straight-through wins" if not wins else f"mixed (soft better on {', '.join(wins)})")
            )
            lines.append(f"{name}, {bits}-bit: {verdict}: the best soft variant ({best['variant']}) against "
                         f"straight-through: {parts}")  # fmt: skip
    return lines


@fragment("dkm_soft", "dkm_soft")
def dkm_soft(results: dict) -> str:
    """`python benchmarks/dkm_quality.py --only soft`: soft assignment against straight-through from the calibrated
    start, with what explains the difference."""
    study = results["dkm_soft"].get("study")
    if not study:
        return "Not measured yet: `python benchmarks/dkm_quality.py --only soft`."
    parts = [
        "Every variant of a model: the same AdamW steps (their number and learning rate with its table) of "
        "distillation from the source model on the same batches, from the same calibrated start "
        '(`recipe="calibrated"`: block scales per 64 inputs, tables refit to the output error, GPTQ-rounded latent '
        "weights), evaluated as saved (the hard "
        "assignment). At the start: blended = the share of weights whose largest attention is under 0.99 at the "
        "variant's temperature, loss = the distillation loss of the model the variant trains (soft or hard) on a "
        "training batch, gradient = the share of latent weights whose gradient is at least a thousandth of their "
        "layer's largest; after training: changed = the share of weights whose table entry changed, moved = the "
        "largest relative move of a table entry."
    ]
    for name, data in study["workloads"].items():
        metrics = data["metrics"]
        head = ["bits", "variant", *metrics, "blended", "loss at start", "gradient", "changed", "moved", "train s"]
        rows = [head]
        for r in data["rows"]:
            if "error" in r:
                rows.append([str(r["bits"]), r["variant"], *["-"] * (len(head) - 3), r["error"][:60]])
                continue
            rows.append([str(r["bits"]), r["variant"], *(_number(r.get(m)) for m in metrics),
                         _number(r.get("blended_at_start")), _number(r.get("loss_at_start")),
                         _number(r.get("gradient_share_at_start")), _number(r.get("changed_entries")),
                         _number(r.get("table_moved")), _number(r.get("train_s", r.get("calibrate_s")))])  # fmt: skip
        held = data.get("held_out") or {}
        what = ", ".join(f"{v:,} {k}" for k, v in held.items())
        budget = f"{data.get('steps', study['steps'])} steps, learning rate {data.get('lr', study['lr']):g}"
        parts.append(f"**{name}** ({budget}; held out: {what}):\n\n" + markdown_table(rows))
    verdicts = study_verdicts(study)
    text = "\n\n".join(parts) + "\n\nThe verdicts:\n\n" + "\n".join(f"- {line}" for line in verdicts)
    return text + f"\n\nThese rows: {_when(study)}.\n\n" + measured({"recorded": study["measured"]})
