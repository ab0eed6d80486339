"""What a training command reports: perplexity, results files as HF's `run_clm` writes them, a results table.

`save_results(trainer, "train", metrics)` writes `train_results.json` and merges it into `all_results.json`
(`Trainer.save_metrics`); for "eval" it adds `perplexity` first, as transformers' own `run_clm.py` does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["count_parameters", "markdown_table", "perplexity", "save_results"]


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
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
