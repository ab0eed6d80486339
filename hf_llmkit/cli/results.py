"""What a training command reports: perplexity, results files as HF's `run_clm` writes them, a results table.

`save_results(trainer, "train", metrics)` writes `train_results.json` and merges it into `all_results.json`
(`Trainer.save_metrics`); for "eval" it adds `perplexity` first, as transformers' own `run_clm.py` does.
`ResumePoint` records the step a run started from (its `resumed_at`). `results_table(setup, results)` is the table
a run ends with: what was trained (`describe_setup`: method, quantization, experts, sequence
parallelism, ranks), parameters counted once per storage, steps, losses, time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

__all__ = [
    "ResumePoint",
    "count_parameters",
    "describe_setup",
    "markdown_table",
    "perplexity",
    "recorded_results",
    "results_table",
    "save_results",
]


class ResumePoint(TrainerCallback):
    """Remembers the step `train()` started from (0 for a new run; the checkpoint's step after a resume)."""

    step: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


def perplexity(loss: float) -> float:
    """exp(loss), or inf where that overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")


def save_results(trainer: Any, split: str, metrics: dict[str, Any]) -> dict[str, Any]:
    """Write `{split}_results.json` and update `all_results.json` (main process); eval metrics gain `perplexity`."""
    metrics = dict(metrics)
    if split == "eval" and "eval_loss" in metrics:
        metrics["perplexity"] = perplexity(metrics["eval_loss"])
    trainer.save_metrics(split, metrics)
    return metrics


def recorded_results(output_dir: str) -> dict[str, Any]:
    """The results a finished run recorded in `output_dir/all_results.json`, under the names `train_and_evaluate`
    returns (`train_loss`, `eval_loss`, `eval_perplexity`); empty when there are none."""
    try:
        recorded = json.loads((Path(output_dir) / "all_results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    names = {"train_loss": "train_loss", "eval_loss": "eval_loss", "perplexity": "eval_perplexity"}
    return {ours: recorded[theirs] for theirs, ours in names.items() if recorded.get(theirs) is not None}


def markdown_table(rows: Sequence[tuple[str, str]], *, header: tuple[str, str] = ("result", "value")) -> str:
    """A two-column markdown table, padded to line up in a terminal."""
    rows = [header, *rows]
    left, right = (max(len(row[i]) for row in rows) for i in (0, 1))
    lines = [f"| {k.ljust(left)} | {v.ljust(right)} |" for k, v in rows]
    lines.insert(1, f"|{'-' * (left + 2)}|{'-' * (right + 2)}|")
    return "\n".join(lines)


def count_parameters(model: Any) -> tuple[int, int]:
    """(all, trainable) parameter counts, each storage counted once: weights tied to another parameter (the output
    layer to the embedding, even as separate `Parameter` objects) are one parameter."""
    unique: dict[tuple[Any, ...], Any] = {}
    for param in model.parameters():
        if param.device.type == "meta":
            key: tuple[Any, ...] = (id(param),)
        else:
            key = (param.device, param.untyped_storage().data_ptr(), param.storage_offset(), tuple(param.shape))
        unique.setdefault(key, param)
    params = unique.values()
    return sum(map(_logical_numel, params)), sum(_logical_numel(p) for p in params if p.requires_grad)


def _logical_numel(param: Any) -> int:
    """Weights, not storage elements: a bitsandbytes 4-bit parameter packs several weights per element."""
    try:
        from bitsandbytes.nn import Params4bit
    except ImportError:
        return param.numel()
    return param.numel() * 2 * param.element_size() if isinstance(param, Params4bit) else param.numel()


def describe_setup(args: Any) -> list[tuple[str, str]]:
    """The results table's rows that say what was trained, from a main job's parsed arguments
    (`hf_llmkit.cli.job.Args`)."""
    from hf_llmkit.cli.features import setup_rows

    return [*setup_rows(args), ("ranks", str(args.training.world_size))]


def _calibration_row(results: dict[str, Any]) -> str:
    when = "before the first step" if results.get("dkm_recipe") == "calibrated" else "after the last step"
    if "global_step" not in results:  # the run did not train
        when = "before the evaluation (no training)"
    return f"{results['dkm_calibration_samples']:,} training examples, {when}"


def _train_loss_title(results: dict[str, Any]) -> str:
    return f"train loss ({results['train_loss_of']})" if results.get("train_loss_of") else "train loss"


def results_table(setup: list[tuple[str, str]], results: dict[str, Any], *, loss_of: str | None = None) -> str:
    """The markdown table a run ends with: `setup` rows, then the results of `train_and_evaluate`; evaluation as
    perplexity, or with `loss_of` as the loss on those tokens ("response tokens")."""

    def fmt(key: str, spec: str = ".3f") -> str:
        value = results.get(key)
        return "-" if value is None else format(value, spec)

    before = f" ({results['eval_before']})" if results.get("eval_before") else ""  # e.g. "the calibrated start"
    evaluation = [
        (f"eval perplexity before{before}", fmt("eval_perplexity_before", ".2f")),
        ("eval perplexity after", fmt("eval_perplexity", ".2f")),
    ]
    losses = [
        (f"eval loss before{before} ({loss_of})", fmt("eval_loss_before")),
        (f"eval loss after ({loss_of})", fmt("eval_loss")),
    ]
    steps = str(results.get("global_step", "-"))
    if results.get("resumed_at") and results["resumed_at"] == results.get("global_step"):
        steps += " (this run had finished: nothing left to train; --overwrite_output_dir true starts over)"
    elif results.get("resumed_at"):
        steps += f" (resumed at step {results['resumed_at']})"
    rows = [
        *setup,
        ("parameters (trainable)", f"{results['parameters']:,} ({results['trainable_parameters']:,})"),
        ("steps", steps),
        *([("resumed from", str(results["resumed_from"]))] if results.get("resumed_from") else []),
        (_train_loss_title(results), fmt("train_loss", ".4g" if results.get("train_loss_of") else ".3f")),
        *([("DKM calibration", _calibration_row(results))] if results.get("dkm_calibration_samples") else []),
        *(evaluation if loss_of is None else losses),
        ("wall time", f"{results['wall_time_s']:.1f} s"),
        ("outputs", results["output_dir"]),
    ]
    if results.get("adapter_base"):
        rows.append(("adapter base", f"{results['adapter_base']} (the model the adapter was trained on)"))
    if results.get("merged_model"):
        rows.append(("merged model", f"{results['merged_model']} (the adapter merged into its base, --merge_adapter)"))
    return markdown_table(rows)
