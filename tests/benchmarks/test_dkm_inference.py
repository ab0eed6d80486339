"""benchmarks/dkm_inference.py's accounting: the bytes a model holds (each storage once, quantization states kept as
attributes included), the per-round ratios to dense bf16 and the target verdicts, on made-up runs; a peer whose
process crashes is a row and the part goes on, saved row by row and resumed with --only-missing; llama.cpp without
its AMX buffers on a CPU that reports AMX."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from areas.inference.report import summarize, table, verdicts  # noqa: E402
from areas.inference.variants import weight_bytes  # noqa: E402


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


def test_a_row_measured_on_a_loaded_machine_is_marked_and_judged_by_no_verdict():
    busy = dict(load_1min=3.5, cores=2, loaded=True)
    ours = "ours DKM 3-bit (a table per tensor)"
    runs = {
        "dense bf16": [_run(10, 1.0, 1600)],
        ours: [{**_run(11, 1.0, 350), **busy}],
        "HQQ 3-bit g64": [_run(9, 1, 300)],
    }
    size = {"specs": {n: {"bits": 16 if n == "dense bf16" else 3} for n in runs}, "threads": {"1": {"runs": runs}}}
    summarize(size)
    lines = verdicts({"sizes": {"tiny": size}})
    assert lines[0] == f"[tiny, 1 thread] {ours}: no verdict (measured at a 1-minute load of 3.5 on 2 cores: " + (
        "rerun with --only-missing)"
    )
    assert "[tiny, 1 thread] 3-bit: no ours row to judge at 3 bits" in lines and len(lines) == 3
    assert f"| **{ours}** (LOADED: load 3.5 > 2 cores) |" in table(size, "1")
    runs["dense bf16"][0].update(busy)  # the base of every ratio loaded: no target is judged
    summarize(size)
    assert verdicts({"sizes": {"tiny": size}})[-1] == (
        "[tiny, 1 thread] 4-bit: no verdict (dense bf16, the base of every ratio, measured on a loaded machine)"
    )
    # a part saved half way, before its base was measured: its rows render, their ratios left empty
    half = {"specs": size["specs"], "threads": {"1": {"runs": {ours: [_run(11, 1.0, 350), None]}}}}
    summarize(half)
    assert half["threads"]["1"]["summary"][ours]["b1_x_bf16"] is None and "| 11.00 " in table(half, "1")
    assert verdicts({"sizes": {"tiny": half}})[0].endswith(
        "no verdict (dense bf16, the base of every ratio, did not run)"
    )


# -- a peer that crashes is a row; the part goes on, saved row by row, and resumes (issue 49) ----------------------


def _llama_part(tmp_path, stored=None):
    """Two llama.cpp rows of part `real` on the shipped file (no preparation), two rounds: the first row's process
    crashes ($HF_LLMKIT_BENCH_CRASH), the second measures (or, without llama-cpp-python, says how to install it)."""
    from areas.inference import runner

    spec = dict(kind="llama_cpp", gguf="Q4_1", bits=4, batch8=False)
    variants = {"llama.cpp Q4_1 (the shipped file)": spec, "llama.cpp Q4_1, again": spec}
    common = dict(dense_dir=str(tmp_path), device="cpu", prompt=4, new_tokens=2, prefill=8, repeats=1,
                  text_ids=list(range(10, 30)), shape=None)  # fmt: skip
    args = SimpleNamespace(jobs=1)
    saves = []
    part = runner.run_part("real", variants, common, args, tmp_path, [1], 2, stored=stored, save=saves.append)
    return part, len(saves)


def test_a_peer_whose_process_crashes_is_a_row_and_the_other_rows_are_measured_and_saved(
    tmp_path, monkeypatch, capsys
):
    from areas.inference import real, runner

    monkeypatch.setenv("HF_LLMKIT_BENCH_CRASH", "llama.cpp Q4_1 (the shipped file)")
    part, saves = _llama_part(tmp_path)
    runs = part["threads"]["1"]["runs"]
    assert saves == 4  # the part was saved after every row
    assert [row["error"] for row in runs["llama.cpp Q4_1 (the shipped file)"]] == [
        "crashed: killed by SIGSEGV (exit -11)"
    ] * 2
    for row in runs["llama.cpp Q4_1, again"]:  # measured in spite of its crashing peer
        assert row.get("tokens_per_s_b1") or row["error"].startswith("llama-cpp-python is not installed"), row
        assert {"load_1min", "cores", "loaded", "round"} <= set(row)
    assert runner.must_run_failures(part) == []  # a peer's crash does not fail the run
    summarize(part)
    [line] = [line for line in real.table(part, "1").splitlines() if "llama.cpp Q4_1 (the shipped file) " in line]
    assert "| did not run: crashed: killed by SIGSEGV (exit -11) " in line
    # --only-missing: the stored part less one row (a killed run) measures that row alone (the others pinned as
    # recorded on an idle machine: a loaded one would be measured again)
    for rows in runs.values():
        for row in rows:
            row["loaded"] = False
    runs["llama.cpp Q4_1, again"][1] = None
    capsys.readouterr()
    resumed, saves = _llama_part(tmp_path, stored=json.loads(json.dumps(part)))
    assert (
        saves == 1
        and "[real] 1 of 4 rows to measure (--only-missing): llama.cpp Q4_1, again" in capsys.readouterr().out
    )
    assert (
        resumed["threads"]["1"]["runs"]["llama.cpp Q4_1 (the shipped file)"]
        == runs["llama.cpp Q4_1 (the shipped file)"]
    )
    assert resumed["threads"]["1"]["runs"]["llama.cpp Q4_1, again"][1]["round"] == 2


# -- llama.cpp on a CPU with AMX: no extra buffer types --------------------------------------------------------------

SAPPHIRE_RAPIDS = (
    "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu vme sse "
    "avx2 avx512f avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8 arch_lbr\n\nprocessor\t: 1\nflags\t\t: fpu\n"
)
EPYC = "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni vaes\n"
GRAVITON = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes sve\n"


def test_llama_cpp_loads_without_extra_buffer_types_where_the_cpu_reports_amx():
    from areas.inference import llamacpp as llama
    from areas.inference import real

    assert llama.amx_flags(SAPPHIRE_RAPIDS) == ["amx_bf16", "amx_tile", "amx_int8"]
    assert not llama.use_extra_bufts(SAPPHIRE_RAPIDS)
    assert (
        llama.use_extra_bufts(EPYC) and llama.use_extra_bufts(GRAVITON) and llama.use_extra_bufts("")
    )  # "": not Linux
    plan = real.plan(quick=False, compile_=False, extra_bufts=False)
    name = "llama.cpp Q4_1 (the shipped file; no AMX/repack buffers: use_extra_bufts=False)"
    assert (
        plan[name]["extra_bufts"] is False
        and "llama.cpp Q3_K_M (no AMX/repack buffers: use_extra_bufts=False)" in plan
    )
    assert "llama.cpp Q4_1 (the shipped file)" in real.plan(quick=True, compile_=False)  # elsewhere: as before
    # the verdicts find llama.cpp's rows by their file, whatever their names say; the issue's targets on one thread:
    # 4 bits at least Q4_0's tokens/s, 3 bits at least 0.9x every llama.cpp file's
    ours, ours3 = (f"ours DKM {bits}-bit scales/64, 8-bit tied embedding, bf16" for bits in (4, 3))
    q4_0 = "llama.cpp Q4_0 (no AMX/repack buffers: use_extra_bufts=False)"
    row = {"tokens_per_s_b1": 50.0, "kernel_ms_per_token": 5.0}
    summary = {ours: row, ours3: dict(row, tokens_per_s_b1=36.0), name: {"tokens_per_s_b1": 40.0},
               q4_0: {"tokens_per_s_b1": 50.5}}  # fmt: skip
    part = {"cpu": "X", "specs": plan, "threads": {"1": {"summary": summary}, "2": {"summary": summary}}}
    lines = real.verdicts(part)
    one, two = ([line for line in lines if line.startswith(f"[SmolLM2-135M, X, {t} thread(s)]")] for t in (1, 2))
    assert any(f"{ours}: 50.0 tokens/s, 0.99x {q4_0}'s 50.5 (FAILS >= 1.0)" in line for line in one), lines
    assert not any(f"{ours}: 50.0 tokens/s, 1.25x {name}" in line for line in one), lines  # Q4_1: no 4-bit target
    assert any(f"{ours3}: 36.0 tokens/s, 0.90x {name}'s 40.0 (holds >= 0.9)" in line for line in one), lines
    assert any(f"{ours3}: 36.0 tokens/s, 0.71x {q4_0}'s 50.5 (FAILS >= 0.9)" in line for line in one), lines
    assert any("llama.cpp Q3_K_M (no AMX" in line and "no comparison (not run)" in line for line in one), lines
    assert any(f"0.99x {q4_0}'s 50.5 (the target >= 1.0 is for 1 thread)" in line for line in two), lines
    summary[name]["loaded"], summary[name]["load_1min"], summary[name]["cores"] = True, 3.0, 2
    assert any(f"vs {name}: no comparison (measured on a loaded machine)" in line for line in real.verdicts(part))


def test_only_missing_measures_just_the_rows_of_a_new_llama_cpp_file():
    """A results entry of part `real` from before the Q4_0 row: `--only-missing` measures its rows and no other."""
    from areas.inference import real, runner
    from harness import slices

    common = {"device": "cpu", "prompt": 16, "new_tokens": 32, "prefill": 512, "repeats": 1, "shape": None}
    specs = {n: {k: v for k, v in dict(common, **s, name=n).items() if k not in runner.HIDDEN}
             for n, s in real.plan(quick=False, compile_=False).items()}  # fmt: skip
    old = {n: s for n, s in specs.items() if n != "llama.cpp Q4_0"}
    runs = {n: [{"tokens_per_s_b1": [1.0]}] * 2 for n in old}
    stored = {"common": runner._json(common), "specs": runner._json(old), "threads": {"1": {"runs": runs}}}
    kept = runner.reusable(stored, specs, common)
    assert slices.to_measure(list(specs), 2, kept["1"]) == [("llama.cpp Q4_0", 0), ("llama.cpp Q4_0", 1)]


def test_use_extra_bufts_false_is_set_on_the_model_params_llama_builds(monkeypatch):
    """`Llama()` has no such argument: the default model parameters it starts from carry it while it loads."""
    import ctypes

    from areas.inference import llamacpp as llama

    class Params(ctypes.Structure):
        _fields_ = [("n_gpu_layers", ctypes.c_int32), ("use_extra_bufts", ctypes.c_bool)]

    module = ModuleType("llama_cpp.llama_cpp")
    module.llama_model_params = Params
    module.llama_model_default_params = lambda: Params(0, True)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", module)
    package = SimpleNamespace(__version__="0.3.36")
    with llama._model_params(package, extra_bufts=False):
        assert module.llama_model_default_params().use_extra_bufts is False  # what Llama(...) reads in its __init__
    assert module.llama_model_default_params().use_extra_bufts is True

    class Old(ctypes.Structure):
        _fields_ = [("n_gpu_layers", ctypes.c_int32)]

    module.llama_model_params = Old
    with pytest.raises(llama.Unavailable, match="has no use_extra_bufts"), llama._model_params(package, False):
        pass


def test_the_onnx_prefill_verdict_is_the_issues_target_and_judges_no_loaded_row():
    """dkm_onnx.py's verdict (issue 53): our kernel's prefill at most 1.5x the dense export's, per size."""
    from areas.inference.onnxrt import DENSE_ROW, KERNEL_ROW, onnx_verdicts

    row = {"prefill_x_dense": 1.5, "b1_x_dense": 1.04, "peak_x_dense": 0.15}
    cell = {"summary": {DENSE_ROW: {"prefill_x_dense": 1.0}, KERNEL_ROW: row}}
    assert onnx_verdicts("issue", cell) == [
        f"[issue, 1 onnxruntime thread] {KERNEL_ROW}: prefill 1.50x the dense export's (holds <= 1.5); batch 1 1.04x "
        "its tokens/s at 0.15x its peak memory"
    ]
    row["prefill_x_dense"] = 1.51
    assert "(FAILS <= 1.5)" in onnx_verdicts("issue", cell)[0]
    row.update(loaded=True, load_1min=5.0, cores=2)
    cell["summary"] = {f"{KERNEL_ROW} (LOADED: load 5.0 > 2 cores)": row, DENSE_ROW: {"prefill_x_dense": 1.0}}
    assert "no verdict (measured at a 1-minute load of 5.0 on 2 cores" in onnx_verdicts("issue", cell)[0]
