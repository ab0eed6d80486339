"""The DKM quality page's verdict lines (benchmarks/areas/catalog.py `_dkm_verdict`) are computed from the results:
which peer is best per metric, at no more bits per weight and at the same index width, with the metric's direction
(perplexity and the worst block's ratio: lower is better; cosines and Spearman: higher)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from areas.dkm.fragments import _dkm_verdict  # noqa: E402


def _row(method, bits, bpw, trained=False, **metrics):
    return {"method": method, "bits": bits, "bpw": bpw, "trained": trained, **metrics}


def test_higher_is_better_metrics_pick_the_best_peer_at_no_more_bits_and_at_the_same_width():
    rows = [
        _row("fp32 (reference)", 32, 32.0, mean_cos=1.0),
        _row("DKM 3-bit (ours)", 3, 3.0, trained=True, mean_cos=0.90),
        _row("k-means 3-bit, no training (ours)", 3, 3.0, mean_cos=0.99),  # untrained rows of ours never count
        _row("cheap peer", 3, 3.0, mean_cos=0.85),
        _row("wide peer", 3, 3.5, mean_cos=0.95),
        _row("broken peer", 3, 3.0, error="ImportError: no module"),
    ]
    [line] = _dkm_verdict("w", ["mean_cos"], rows)
    assert line == (
        "- w, DKM 3-bit: mean_cos 0.9: at no more bits 0.85 (cheap peer, 3.00) behind us, "
        "any 3-bit peer 0.95 (wide peer, 3.50) ahead of us"
    )


def test_lower_is_better_for_perplexity_and_a_width_without_our_trained_row_says_nothing():
    rows = [
        _row("DKM 4-bit (ours)", 4, 4.0, trained=True, ppl=150.0),
        _row("GPTQ", 4, 4.25, ppl=149.0),
        _row("RTN", 4, 4.0, ppl=170.0),
        _row("HQQ 3-bit", 3, 3.5, ppl=200.0),
    ]
    [line] = _dkm_verdict("lm", ["ppl"], rows)
    assert "at no more bits 170 (RTN, 4.00) behind us" in line
    assert "any 4-bit peer 149 (GPTQ, 4.25) ahead of us" in line
