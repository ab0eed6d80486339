"""The real-model sections of dkm_quality.py (benchmarks/real.py, areas/dkm/real_report.py): rows measured a width
at a time merge into one table, and the verdict lines against issue 43's targets are computed from the rows (KL,
perplexity and the worst block lower is better, top-1 agreement higher; a peer with fewer bits is named apart; the
seed margin against the seed spread; training against its start on every metric)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from areas.dkm import real  # noqa: E402
from areas.dkm.real_report import dkm_calibration_cost, dkm_recipe, dkm_smollm2, verdicts  # noqa: E402

METRICS = ["ppl", "kl", "top1", "worst_block_ratio"]
RECORD = {"date": "2026-11-29 06:00", "started": None, "command": "python benchmarks/dkm_quality.py --only smollm2",
          "machine": {"cores": 2, "cpu": "cpu", "torch_threads": 1, "gpu": None, "torch": "2.14"},
          "load_1min": {"start": 1.0, "end": 1.0, "max": 1.0, "mean": 1.0, "samples": 2}, "loaded": False}  # fmt: skip


def _row(method, bits, bpw, ppl, kl, top1=0.8, worst=1.2, **extra):
    return {"method": method, "bits": bits, "bpw": bpw, "ppl": ppl, "kl": kl, "top1": top1,
            "worst_block_ratio": worst, **extra}  # fmt: skip


def _section(rows, command="python benchmarks/dkm_quality.py --only smollm2 --bits 3"):
    return {"model": "SmolLM2-135M-Instruct", "parameters": 134.5e6, "layers": 30, "quantized_parameters": 106e6,
            "split": {"held_out_texts": 20, "texts": 1993, "eval_tokens": 16384, "train_tokens": 90000},
            "embedding_parameters": 28.3e6, "block": 512, "calibration": [128, 256], "train_batch": [4, 128],
            "metrics": METRICS, "steps": 40,
            "lr": 2e-5, "rows": rows, "embedding_rows": [], "llama_cpp_tokenizer": None,
            "measured": {**RECORD, "command": command}}  # fmt: skip


START, TRAINED = real._names(3)["start"], real._names(3)["trained"]


def test_a_width_measured_again_replaces_its_rows_and_keeps_the_others():
    first = real.merge(None, _section([_row("fp32 (reference)", 32, 32.0, 20.0, 0.0),
                                            _row("GPTQ 2-bit", 2, 2.28, 40.0, 0.9)], command="--bits 2"))  # fmt: skip
    again = real.merge(first, _section([_row("fp32 (reference)", 32, 32.0, 20.0, 0.0),
                                             _row("GPTQ 3-bit", 3, 3.3, 25.0, 0.2)]))  # fmt: skip
    assert [r["method"] for r in again["rows"]] == ["fp32 (reference)", "GPTQ 2-bit", "GPTQ 3-bit"]
    assert [r["command"] for r in again["runs"]] == [
        "--bits 2",
        "python benchmarks/dkm_quality.py --only smollm2 --bits 3",
    ]
    later = _section([_row("GPTQ 3-bit", 3, 3.3, 24.0, 0.2)])  # the same run saved again after its next row
    later["measured"] = {**later["measured"], "date": "2026-11-29 07:00"}
    assert [r["date"] for r in real.merge(again, later)["runs"]] == ["2026-11-29 06:00", "2026-11-29 07:00"]
    idle = _section([], command="--bits 3 again")  # a rerun that found every row recorded: no run of these rows
    assert [r["command"] for r in real.merge(again, idle)["runs"]] == [r["command"] for r in again["runs"]]


def test_verdicts_hold_against_every_row_up_to_the_next_whole_bit_and_llama_cpp_below_5_bits():
    every = "every row at 3.25 to 4 bits/weight"
    rows = [
        _row(START, 3, 3.25, 24.0, 0.20, top1=0.80, worst=1.30, trained=False),
        _row(TRAINED, 3, 3.25, 23.0, 0.15, top1=0.82, worst=1.25, trained=True),
        _row("GPTQ 3-bit g64 (llmcompressor)", 3, 3.30, 23.5, 0.18),
        _row("coremltools k-means 3-bit", 3, 3.00, 22.0, 0.40),  # fewer bits, a lower perplexity
        _row("llama.cpp Q3_K_S", 3, 4.23, 21.0, 0.05),  # labelled 3-bit, 4.23 bits/weight: not below 4, no rival
        _row("HQQ 2-bit g64", 2, 3.5, 30.0, 0.12),  # labelled 2-bit, 3.5 bits/weight: a rival at 3 bits
        _row("llama.cpp, the source Q4_1 file", 4, 5.0, 20.0, 0.001, reference=True),  # never a rival
    ]
    lines = verdicts(_section(rows), {})
    kl, ppl = lines[0], lines[1]
    assert kl.startswith("- 3-bit, kl 0.1500 (" + TRAINED) and f"NOT the lowest of {every}: HQQ 2-bit g64" in kl
    assert "Q3_K_S" not in kl and "with fewer bits: coremltools k-means 3-bit 0.4000 (3.00, behind us)" in kl
    assert f"lowest of {every}" in ppl and "coremltools k-means 3-bit 22.00 (3.00, AHEAD OF us)" in ppl
    assert lines[2] == (f"- 3-bit, {TRAINED}: improves on its start on every metric: ppl 24.00 -> 23.00, "
                        "kl 0.2000 -> 0.1500, top1 0.8000 -> 0.8200, worst_block_ratio 1.3000 -> 1.2500")  # fmt: skip
    rows[5]["kl"] = 0.3
    rows[2] = _row("GPTQ 3-bit g64 (llmcompressor)", 3, 3.30, 22.5, 0.10, top1=0.9)
    rows[1]["worst_block_ratio"] = 1.4
    lines = verdicts(_section(rows), {})
    assert f"NOT the lowest of {every}: GPTQ 3-bit g64 (llmcompressor) 0.1000 (3.30)" in lines[0]
    assert "does NOT improve on its start" in lines[2]
    alone = verdicts(_section([r for r in rows if "GPTQ" not in r["method"] and "HQQ" not in r["method"]]), {})
    assert f"NOT SHOWN: {every}: none measured yet" in alone[0] and "lowest" not in alone[0]
    four = [_row(START.replace("3-bit", "4-bit"), 4, 4.25, 13.0, 0.06), _row("llama.cpp Q4_0", 4, 4.5, 13.5, 0.08),
            _row("llama.cpp Q5_0", 4, 5.5, 12.5, 0.01), _row("HQQ 4-bit g64", 4, 4.5, 12.9, 0.03)]  # fmt: skip
    (line,) = verdicts(_section(four), {})
    assert line.startswith("- 4-bit, kl 0.0600") and "lowest of every llama.cpp format below 5 bits/weight" in line
    # a verdict over part of the planned rows says which are missing (the GPTQ g128 and QAT rows, ours trained ...)
    assert "NOT MEASURED YET (a verdict over the rows above only): " in line and "torchao QAT int4 g64" in line
    assert "HQQ 4-bit g64" not in line.split("NOT MEASURED YET")[1]
    assert "GPTQ 3-bit g128 (llmcompressor)" in lines[0] and "GPTQ 3-bit g64 (llmcompressor), " not in lines[0]


def test_the_seed_margin_counts_a_data_free_peer_as_the_same_at_every_seed():
    rows = [_row(TRAINED, 3, 3.25, 23.0, 0.15, trained=True), _row("HQQ 3-bit g64", 3, 3.5, 30.0, 0.30),
            _row("GPTQ 3-bit g64 (llmcompressor)", 3, 3.30, 23.5, 0.18)]  # fmt: skip
    seeds = {"1": {"rows": [_row(TRAINED, 3, 3.25, 23.2, 0.16), _row("GPTQ 3-bit g64 (llmcompressor)", 3, 3.3,
                                                                       23.4, 0.175)]}}  # fmt: skip
    kl = verdicts(_section(rows), seeds)[0]
    assert "margin 0.0150 over the best such peer at either seed, larger than the seed-to-seed spread 0.0100" in kl


def test_every_real_model_fragment_renders_from_results_and_says_when_not_measured():
    empty = {"dkm_quality": {"recorded": RECORD, "workloads": {}}}
    for render in (dkm_smollm2, dkm_calibration_cost, dkm_recipe):
        assert render(empty).startswith("Not measured yet: `python benchmarks/dkm_quality.py --only ")
    rows = [_row("fp32 (reference)", 32, 32.0, 20.0, 0.0), _row(TRAINED, 3, 3.25, 23.0, 0.15, trained=True),
            _row("HQQ 2-bit g64", 2, 2.5, 0, 0, error="ImportError: hqq")]  # fmt: skip
    text = dkm_smollm2({"dkm_quality": {"recorded": RECORD, "real_model": real.merge(None, _section(rows))}})
    assert f"**{TRAINED}**" in text and "| 23.00 " in text and "| 0.1500 " in text
    assert "did not run: ImportError: hqq" in text and "_Measured 2026-11-29 06:00" in text
    # whole model MB: the decoder at its bits, the tied embedding float32 / 8-bit, the rest float32; llama.cpp's files
    assert "| 157.1 / 72.2 " in text
    gguf = _row("llama.cpp Q4_0 (its own mix)", 4, 4.5, 21.0, 0.1, weights_mb=173.4, embedding="F32",
                default_file_mb=88.5, default_embedding="Q8_0")  # fmt: skip
    text = dkm_smollm2({"dkm_quality": {"recorded": RECORD, "real_model": real.merge(None, _section([gguf]))}})
    assert "| 173.4 (F32) / 88.5 (Q8_0) " in text
    cost = {"summary": {"ours": {"min_s": 90, "median_s": 95, "ratio_min": 0.5, "ratio_median": 0.55},
                        "GPTQ": {"min_s": 180, "median_s": 185, "ratio_min": 1.0, "ratio_median": 1.0}},
            "seconds": {"ours": [90, 100], "GPTQ": [180, 190]}, "cpu_seconds": {"ours": [80, 85], "GPTQ": [170, 175]},
            "ours": "ours", "peer": "GPTQ", "bits": 3, "samples": [128, 256], "torch_threads": 1, "ratio_min": 0.5,
            "ratio_median": 0.55, "cpu_ratio_min": 0.47, "cpu_ratio_median": 0.48, "measured": RECORD}  # fmt: skip
    text = dkm_calibration_cost({"dkm_quality": {"recorded": RECORD, "real_model_calibration": cost}})
    assert "no more time than GPTQ: holds (ours / GPTQ, min / median: wall 0.50 / 0.55, CPU 0.47 / 0.48)" in text


def test_a_real_model_run_keeps_the_workloads_settings(tmp_path):
    """Found on the first real-model run: `--only smollm2 --steps 24` rewrote the top-level steps that the MiniLM and
    small-Llama tables were trained with (their text then said 24 steps for rows trained 40)."""
    import json

    import dkm_quality

    path = tmp_path / "dkm_quality.json"
    earlier = {"steps": 40, "lr": 2e-5, "workloads": {"minilm": {"rows": []}}}
    path.write_text(json.dumps(earlier))
    fresh = {"steps": 24, "lr": 1e-4, "workloads": {}, "real_model": _section([_row(START, 3, 3.25, 24.0, 0.2)])}
    merged = dkm_quality._merge_into(path, fresh)
    data = json.loads(merged.read_text())
    assert data["steps"] == 40 and data["lr"] == 2e-5 and "minilm" in data["workloads"] and data["real_model"]
