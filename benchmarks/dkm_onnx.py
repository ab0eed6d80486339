"""onnxruntime serving of DKM exports against the dense ONNX export: batch-1 generate speed, prefill, memory.

    python benchmarks/dkm_onnx.py                  # the issue's Llama (hidden 1024, 8 layers) and the real SmolLM2
    python benchmarks/dkm_onnx.py --quick          # a tiny Llama, one round: a smoke test
    python benchmarks/dkm_onnx.py --sizes smollm2  # only the real model (the whole 30 layers)

One DKM 3-bit checkpoint per size (bf16 tables, `from_pretrained(..., quantization_config=DKMConfig(bits=3))` of the
dense model, saved and reloaded) is exported three ways with `export_onnx`: `dense=True` (the decoded float32
weights: the dense ONNX export users would otherwise serve), packed with the palettized nodes run by onnxruntime's
standard ops (their function definitions inlined), and the same packed file opened with `onnxruntime_session` (our
C kernel through onnxruntime-extensions). Each variant runs in a fresh process per round, in an order rotated each
round, one intra-op thread: `greedy_generate` of batch 1 (tokens/s after a warm-up, the standard-op path over fewer
tokens: it decodes every weight per token), one prefill forward, the file's bytes and the peak resident memory over
the imports (`VmHWM` after `clear_refs`: the session's creation and serving). The tokens each variant generates must
equal the PyTorch model's. Writes benchmarks/results/dkm_onnx.json; docs/dkm.md's export section renders it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import add_device_argument, machine_state, write_results  # noqa: E402
from _process_memory import reset_peak, status_kib  # noqa: E402

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


def run_size(size: str, args, work: Path) -> dict:
    prepared = json.loads(_child(["--prepare", size, str(work)], work, 7200))
    runs = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    before = machine_state()
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            v = VARIANTS[name]
            spec = dict(
                v,
                file=prepared["files"][v["file"]],
                prompt=prepared["prompt"],
                reference=prepared["reference"],
                prefill=args.prefill,
                new_tokens=args.new_tokens if v["kernel"] or v["file"] == "dense" else args.slow_tokens,
            )
            got = json.loads(_child(["--measure", json.dumps(spec)], work, 3600))
            runs[name].append(got)
            print(f"[{size}, round {r + 1}] {name}: {got['tokens_per_s_b1']:.2f} tokens/s", flush=True)
            if not got["tokens_equal"]:
                raise SystemExit(f"error: {name} generated other tokens than the PyTorch model")
    prepared = {k: v for k, v in prepared.items() if k != "files"}  # paths of this machine's temporary folder
    return {"prepared": prepared, "runs": runs, "summary": summarize(runs), "before": before, "after": machine_state()}


def summarize(runs: dict) -> dict:
    out = {}
    for name, got in runs.items():
        speed = [g["tokens_per_s_b1"] / b["tokens_per_s_b1"] for g, b in zip(got, runs[BASE])]
        out[name] = {
            "tokens_per_s_b1": statistics.median(g["tokens_per_s_b1"] for g in got),
            "b1_x_dense": statistics.median(speed),
            "b1_x_dense_range": [min(speed), max(speed)],
            "prefill_s": statistics.median(g["prefill_s"] for g in got),
            "prefill_x_dense": statistics.median(g["prefill_s"] / b["prefill_s"] for g, b in zip(got, runs[BASE])),
            "peak_over_base_mib": max(g["peak_over_base_mib"] for g in got),
            "load_s": statistics.median(g["load_s"] for g in got),
            "file_mib": got[0]["file_mib"],
        }
    for s in out.values():
        s["peak_x_dense"] = s["peak_over_base_mib"] / out[BASE]["peak_over_base_mib"]
    return out


def _child(argv: list[str], work: Path, timeout: float) -> str:
    out = work / f"child-{time.monotonic_ns()}.json"
    done = subprocess.run([sys.executable, __file__, *argv, "--out", str(out)], timeout=timeout)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"error: {argv[0]} failed (exit {done.returncode}; its traceback is above)")
    return out.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, one round")
    parser.add_argument("--sizes", nargs="*", choices=list(SHAPES), default=None, help="(default: issue smollm2)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens timed (dense and our kernel)")
    parser.add_argument("--slow-tokens", type=int, default=2, help="tokens timed on the standard-op path")
    parser.add_argument("--prefill", type=int, default=128, help="tokens of the prefill forward")
    add_device_argument(parser)
    parser.add_argument("--prepare", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare:
        Path(args.out).write_text(json.dumps(prepare(args.prepare[0], Path(args.prepare[1]))))
        return
    if args.measure:
        Path(args.out).write_text(json.dumps(measure(json.loads(args.measure))))
        return
    if args.device not in (None, "cpu"):
        parser.error("onnxruntime runs here on the CPU: --device cpu (or leave it out)")
    sizes = args.sizes or (["tiny"] if args.quick else ["issue", "smollm2"])
    if args.quick:
        args.rounds, args.new_tokens, args.slow_tokens, args.prefill = 1, 4, 2, 16
    started = time.perf_counter()
    results: dict = {
        "argv": sys.argv[1:],
        "config": {k: getattr(args, k) for k in ("rounds", "new_tokens", "slow_tokens", "prefill")},
    }
    results["sizes"] = {}
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix=f"dkm_onnx_{size}_") as tmp:
            results["sizes"][size] = run_size(size, args, Path(tmp))
        results["seconds"] = time.perf_counter() - started
        write_results("dkm_onnx", results)  # after each size: a long run stopped later keeps the sizes it finished
    for size, data in results["sizes"].items():
        print(f"\n{size}: " + json.dumps(data["summary"], indent=1))
    print(f"\nwrote {write_results('dkm_onnx', results)}")


if __name__ == "__main__":
    main()
