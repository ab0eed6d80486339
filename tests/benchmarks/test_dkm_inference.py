"""benchmarks/dkm_inference.py's accounting: the bytes a model holds (each storage once, quantization states kept as
attributes included), the per-round ratios to dense bf16 and the target verdicts, on made-up runs."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _inference_report import summarize, verdicts  # noqa: E402
from _inference_variants import weight_bytes  # noqa: E402


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 16, bias=False), nn.Linear(16, 8)])
        self.layers[1].meta = {"scale": torch.zeros(4, dtype=torch.float16), "nested": [torch.zeros(3)]}
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage


def test_weight_bytes_counts_each_storage_once_and_tensors_kept_as_attributes():
    got = weight_bytes(_Model())
    decoder = 8 * 16 * 4 + (16 * 8 + 8) * 4 + 4 * 2 + 3 * 4
    assert got == {"decoder": decoder, "model": decoder + 10 * 8 * 4}


def _run(tps: float, prefill: float, decoder: int) -> dict:
    return {
        "tokens_per_s_b1": [tps],
        "tokens_per_s_b8": [4 * tps],
        "times": {"prefill": [prefill]},
        "weight_bytes": decoder + 100,
        "decoder_weight_bytes": decoder,
        "peak_rss_mib": 500.0,
        "peak_rss_load_mib": 500.0,
        "rss_base_mib": 300.0,
        "peak_rss_inference_mib": 400.0,
        "load_s": 1.0,
        "modules": "X",
    }


def test_ratios_are_per_round_and_verdicts_name_what_holds_and_what_fails():
    runs = {
        "dense bf16": [_run(10, 1.0, 1600), _run(5, 2.0, 1600)],  # the machine got twice as slow in round 2
        "ours DKM 3-bit (a table per tensor)": [_run(11, 1.4, 350), _run(5.5, 2.8, 350)],
        "ours DKM 4-bit (a table per tensor)": [_run(8, 1.0, 450), _run(4, 2.0, 450)],
        "HQQ 3-bit g64": [_run(12, 1.0, 300), _run(6, 1.0, 300)],
        "HQQ 4-bit g64": [_run(8.5, 1.0, 400), _run(4.25, 1.0, 400)],
        "torchao int4 g64 weight-only": [{"error": "no cpu layout"}] * 2,
    }
    bits = {"dense bf16": 16, "HQQ 3-bit g64": 3, "HQQ 4-bit g64": 4, "torchao int4 g64 weight-only": 4}
    specs = {name: {"bits": bits.get(name, 3 if "3-bit" in name else 4)} for name in runs}
    size = {"specs": specs, "threads": {"1": {"runs": runs}}}
    summarize(size)
    summary = size["threads"]["1"]["summary"]
    ours3 = summary["ours DKM 3-bit (a table per tensor)"]
    assert ours3["b1_x_bf16"] == 1.1 and ours3["prefill_x_bf16"] == 1.4
    assert ours3["decoder_weights_x_bf16"] == 350 / 1600
    assert ours3["peak_load_over_base_mib"] == 200 and ours3["peak_inference_over_base_mib"] == 100
    assert summary["torchao int4 g64 weight-only"] == {"error": "no cpu layout"}
    lines = verdicts({"sizes": {"tiny": size}})
    assert "ours DKM 3-bit (a table per tensor): batch-1 tokens/s 1.10x dense bf16 (holds >= 1)" in lines[0]
    assert "(holds <= 0.25)" in lines[0] and "(holds <= 1.5)" in lines[0]
    assert "(FAILS >= 1)" in lines[1] and "(FAILS <= 0.25)" in lines[1]
    three = next(line for line in lines if " 3-bit: " in line)
    assert three.startswith("[tiny, 1 thread] 3-bit: ours the fastest 3-bit format: FAILS") and "HQQ 3-bit" in three
    four = next(line for line in lines if " 4-bit: " in line)
    assert "within 10% of the fastest 4-bit format: holds" in four and "0.94x" in four
