"""onnxruntime serving of DKM exports against the dense ONNX export: batch-1 generate speed, prefill, memory.

    python benchmarks/dkm_onnx.py                  # the issue's Llama (hidden 1024, 8 layers) and the real SmolLM2
    python benchmarks/dkm_onnx.py --quick          # a tiny Llama, one round, children forked: a smoke test
    python benchmarks/dkm_onnx.py --sizes smollm2  # only the real model (the whole 30 layers)
    python benchmarks/dkm_onnx.py --only-missing   # the rows a killed (or loaded) run left missing

One DKM 3-bit checkpoint per size (bf16 tables, `from_pretrained(..., quantization_config=DKMConfig(bits=3))` of the
dense model, saved and reloaded) is exported three ways with `export_onnx`: `dense=True` (the decoded float32
weights: the dense ONNX export users would otherwise serve), packed with the palettized nodes run by onnxruntime's
standard ops (their function definitions inlined), and the same packed file opened with `onnxruntime_session` (our
C kernel through onnxruntime-extensions). Each variant runs in a fresh process per round, in an order rotated each
round, one intra-op thread: `greedy_generate` of batch 1 (tokens/s after a warm-up, the standard-op path over fewer
tokens: it decodes every weight per token), one prefill forward, the file's bytes and the peak resident memory over
the imports (`VmHWM` after `clear_refs`: the session's creation and serving). The tokens each variant generates must
equal the PyTorch model's; the target (issue 53): our kernel's prefill at most 1.5x the dense export's
(`areas/inference/onnxrt.py`'s verdict, printed and rendered). Writes benchmarks/results/dkm_onnx.json, row by row
as they are measured (`harness/slices.py`): a variant whose process crashes or hangs is a row with its reason (the
run then fails at its end, as it does when a variant's tokens differ), and `--only-missing` measures only the rows
the file lacks or holds from a loaded machine (their table rows marked LOADED). docs/dkm.md's export section renders
it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from areas.inference.onnxrt import onnx_verdicts  # noqa: E402
from harness import slices  # noqa: E402
from harness.common import add_device_argument, cpu_model, machine_state  # noqa: E402
from harness.process_memory import reset_peak, status_kib  # noqa: E402

SHAPES = {
    "tiny": dict(hidden=128, layers=2, intermediate=384, vocab=4096, heads=4),
    "issue": dict(hidden=1024, layers=8, intermediate=2816, vocab=4096, heads=16),
    "smollm2": None,  # hf_llmkit.testing.smollm2_path(): SmolLM2-135M-Instruct, 30 layers
}
VARIANTS = {
    "onnxruntime dense fp32 export": dict(file="dense", kernel=False),
    "onnxruntime DKM 3-bit, standard ops": dict(file="packed", kernel=False),
    "onnxruntime DKM 3-bit, our kernel (onnxruntime-extensions)": dict(file="packed", kernel=True),
}
BASE = "onnxruntime dense fp32 export"


def prepare(size: str, work: Path) -> dict:
    """The checkpoint, the two exports and the PyTorch model's greedy tokens (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from hf_llmkit import DKMConfig
    from hf_llmkit.quantization import export_onnx

    torch.manual_seed(0)
    if SHAPES[size] is None:
        from hf_llmkit.testing import smollm2_path

        dense = smollm2_path()
    else:
        s = SHAPES[size]
        config = LlamaConfig(
            hidden_size=s["hidden"],
            intermediate_size=s["intermediate"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            vocab_size=s["vocab"],
            tie_word_embeddings=False,
        )
        dense = work / "dense"
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(dense)
    quantization = DKMConfig(bits=3, lut_dtype="bfloat16", kmeans_iters=5, kmeans_sample=4096)
    AutoModelForCausalLM.from_pretrained(dense, quantization_config=quantization).save_pretrained(work / "dkm")
    model = AutoModelForCausalLM.from_pretrained(work / "dkm").eval()
    started = time.perf_counter()
    export_onnx(model, work / "packed")
    export_s = time.perf_counter() - started
    export_onnx(model, work / "dense_onnx", dense=True)
    prompt = torch.randint(3, min(model.config.vocab_size, 4096), (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return {
        "prompt": prompt.tolist(),
        "reference": tokens.tolist(),
        "export_s": export_s,
        "files": {"packed": str(work / "packed" / "model.onnx"), "dense": str(work / "dense_onnx" / "model.onnx")},
    }


def measure(spec: dict) -> dict:
    """One variant in this (fresh) process."""
    import numpy as np
    import onnxruntime
    import onnxruntime_extensions  # noqa: F401  (imported by every variant: the base excludes it)
    import torch

    from hf_llmkit.quantization.export import greedy_generate, onnxruntime_session

    torch.set_num_threads(1)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    reset_peak()
    base = status_kib("VmRSS")
    started = time.perf_counter()
    session = (
        onnxruntime_session(spec["file"], options)
        if spec["kernel"]
        else onnxruntime.InferenceSession(spec["file"], options)
    )
    load_s = time.perf_counter() - started
    prompt = np.array(spec["prompt"])
    check = greedy_generate(session, prompt, max_new_tokens=len(spec["reference"][0]) - prompt.shape[1])
    n = spec["new_tokens"]
    started = time.perf_counter()
    greedy_generate(session, prompt, max_new_tokens=n)
    generate_s = time.perf_counter() - started
    long = np.random.default_rng(0).integers(3, 4096, (1, spec["prefill"]))
    started = time.perf_counter()
    greedy_generate(session, long, max_new_tokens=1)
    prefill_s = time.perf_counter() - started
    return {
        "tokens_equal": check.tolist() == spec["reference"],
        "tokens_per_s_b1": n / generate_s,
        "prefill_s": prefill_s,
        "load_s": load_s,
        "peak_over_base_mib": (status_kib("VmHWM") - base) / 1024,
        "file_mib": sum(p.stat().st_size for p in Path(spec["file"]).parent.glob("model.onnx*")) / 2**20,
    }


def run_size(size: str, args, work: Path, stored: dict | None, save) -> dict:
    """One size: the exports (made only when a row is to be measured), then `rounds` rounds of every variant, each a
    fresh process; `save(size, entry)` after every row. `stored` (--only-missing): the size's entry in the file."""
    prepared: dict = {}

    def child(argv: list[str], out: Path, target, target_args: tuple, name: str, timeout: float) -> dict:
        """A fresh interpreter (`python dkm_onnx.py --prepare/--measure ...`); with --quick a child forked from this
        process after one import of the stack (`_preimport`), running the same function."""
        if args.quick:
            return slices.run_child(target, target_args, out, name=name, timeout=timeout)
        return slices.run_command(_argv(*argv, out=out), out, timeout=timeout)

    def measure(name: str, r: int) -> dict:
        if not prepared:
            out = work / "prepared.json"
            got = child(["--prepare", size, str(work)], out, _prepare_to, (size, str(work)), "prepare", 7200)
            if "error" in got:  # our own export: nothing of this size can be measured without it
                raise SystemExit(f"error: the exports of {size} failed: {got['error']}")
            prepared.update(got)
        v = VARIANTS[name]
        spec = dict(
            v,
            name=name,
            file=prepared["files"][v["file"]],
            prompt=prepared["prompt"],
            reference=prepared["reference"],
            prefill=args.prefill,
            new_tokens=args.new_tokens if v["kernel"] or v["file"] == "dense" else args.slow_tokens,
        )
        out = work / f"measure-{time.monotonic_ns()}.json"
        return child(["--measure", json.dumps(spec)], out, _measure_to, (spec,), name, 3600)

    entry = {"prepared": (stored or {}).get("prepared"), "before": machine_state()}

    def on_row(name: str, r: int, runs: dict) -> None:
        row = runs[name][r]
        got = row.get("error") or f"{row['tokens_per_s_b1']:.2f} tokens/s"
        print(f"[{size}, round {r + 1}] {name if 'error' in row else slices.mark(name, row)}: {got}", flush=True)
        if prepared:  # the paths of this machine's temporary folder stay out
            entry["prepared"] = {k: v for k, v in prepared.items() if k != "files"}
        entry.update(runs=runs, after=machine_state(), **summarize(runs))
        save(size, entry)

    kept = None if stored is None else stored.get("runs", {})
    runs = slices.measure_rounds(list(VARIANTS), args.rounds, measure, stored=kept, on_row=on_row)
    entry.update(runs=runs, **summarize(runs))
    return entry


def summarize(runs: dict) -> dict:
    """`summary`: per variant measured in a round with the dense export, the medians and the per-round ratios to
    it (the name carries the LOADED mark where a row was measured above the core count: the docs table renders the
    names); `not_run`: the variants whose rows are errors, with the first; `wrong_tokens`: those whose tokens differ
    from the PyTorch model's."""
    out, base = {}, runs.get(BASE, [])
    for name, got in runs.items():
        pairs = [(g, b) for g, b in zip(got, base) if g and b and "error" not in g and "error" not in b]
        if not pairs:
            continue
        ok = [g for g, _ in pairs]
        speed = [g["tokens_per_s_b1"] / b["tokens_per_s_b1"] for g, b in pairs]
        out[name] = {
            "tokens_per_s_b1": statistics.median(g["tokens_per_s_b1"] for g in ok),
            "b1_x_dense": statistics.median(speed),
            "b1_x_dense_range": [min(speed), max(speed)],
            "prefill_s": statistics.median(g["prefill_s"] for g in ok),
            "prefill_x_dense": statistics.median(g["prefill_s"] / b["prefill_s"] for g, b in pairs),
            "peak_over_base_mib": max(g["peak_over_base_mib"] for g in ok),
            "load_s": statistics.median(g["load_s"] for g in ok),
            "file_mib": ok[0]["file_mib"],
            **slices.load_of(ok),
        }
    for s in out.values():
        s["peak_x_dense"] = s["peak_over_base_mib"] / out[BASE]["peak_over_base_mib"]
    errors = {name: next(g["error"] for g in got if g and "error" in g) for name, got in runs.items()
              if any(g and "error" in g for g in got)}  # fmt: skip
    wrong = sorted(name for name, got in runs.items() if any(g and g.get("tokens_equal") is False for g in got))
    summary = {slices.mark(name, v): v for name, v in out.items()}
    return {"summary": summary, "not_run": errors, "wrong_tokens": wrong}


def _prepare_to(size: str, work: str, out: str) -> None:
    Path(out).write_text(json.dumps(prepare(size, Path(work))))


def _measure_to(spec: dict, out: str) -> None:
    Path(out).write_text(json.dumps(measure(spec)))


def _preimport() -> None:
    """--quick: what the children import, once here before they fork (torch, transformers, hf_llmkit, onnxruntime)."""
    import onnxruntime  # noqa: F401
    import onnxruntime_extensions  # noqa: F401
    import torch
    import transformers  # noqa: F401

    import hf_llmkit  # noqa: F401
    from hf_llmkit.quantization import export  # noqa: F401

    torch.set_num_threads(1)


def _argv(*argv: str, out: Path) -> list[str]:
    return [sys.executable, __file__, *argv, "--out", str(out)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny Llama, one round, the children forked from this process")  # fmt: skip
    parser.add_argument("--sizes", nargs="*", choices=list(SHAPES), default=None, help="(default: issue smollm2)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens timed (dense and our kernel)")
    parser.add_argument("--slow-tokens", type=int, default=2, help="tokens timed on the standard-op path")
    parser.add_argument("--prefill", type=int, default=128, help="tokens of the prefill forward")
    slices.add_only_missing_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--prepare", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare or args.measure:  # a child: it dies with the benchmark
        slices.die_with_parent()
    if args.prepare:
        Path(args.out).write_text(json.dumps(prepare(args.prepare[0], Path(args.prepare[1]))))
        return
    if args.measure:
        spec = json.loads(args.measure)
        slices.crash_if_named(spec["name"])  # fault injection ($HF_LLMKIT_BENCH_CRASH); nothing otherwise
        Path(args.out).write_text(json.dumps(measure(spec)))
        return
    if args.device not in (None, "cpu"):
        parser.error("onnxruntime runs here on the CPU: --device cpu (or leave it out)")
    sizes = args.sizes or (["tiny"] if args.quick else ["issue", "smollm2"])
    if args.quick:  # a smoke test: the children fork from this process, the stack imported once
        args.rounds, args.new_tokens, args.slow_tokens, args.prefill = 1, 4, 2, 16
        _preimport()
    started = time.perf_counter()
    config = {k: getattr(args, k) for k in ("rounds", "new_tokens", "slow_tokens", "prefill")}
    stored = slices.read_results("dkm_onnx")
    results: dict = {"argv": sys.argv[1:], "cpu": cpu_model(), "config": config}
    results["sizes"] = slices.kept_sizes("dkm_onnx", stored, {"cpu": cpu_model()}, config, sizes, args.only_missing)

    def save(size: str, entry: dict) -> None:
        results["sizes"][size] = entry
        results["seconds"] = time.perf_counter() - started
        slices.update_results("dkm_onnx", {(key,): value for key, value in results.items()})

    for size in sizes:
        with tempfile.TemporaryDirectory(prefix=f"dkm_onnx_{size}_") as tmp:
            kept = results["sizes"].get(size, {}) if args.only_missing else None
            save(size, run_size(size, args, Path(tmp), kept, save))
    for size, data in results["sizes"].items():
        print(f"\n{size}: " + json.dumps(data["summary"], indent=1) + "\n" + "\n".join(onnx_verdicts(size, data)))
    print(f"\nwrote {slices.results_path('dkm_onnx')}")
    failed = []
    for size in sizes:
        failed += [f"{size}: {name} did not run: {why}" for name, why in results["sizes"][size]["not_run"].items()]
        failed += [
            f"{size}: {name}'s tokens differ from the PyTorch model's"
            for name in results["sizes"][size]["wrong_tokens"]
        ]
    if failed:  # every row is written: the run fails after it
        raise SystemExit("error: " + "; ".join(failed))


if __name__ == "__main__":
    main()
