"""DKM packed inference on the CPU it runs on, against dense, llama.cpp and the 3-4 bit formats users deploy.

    python benchmarks/dkm_inference.py                 # every part (below); the peers at the issue's and ~1B sizes
    python benchmarks/dkm_inference.py --parts loops   # one part
    python benchmarks/dkm_inference.py --quick         # tiny models, one round, a few variants: a smoke test
    python benchmarks/dkm_inference.py --threads 1 2   # each thread count its own rounds (parts real and peers)
    python benchmarks/dkm_inference.py --device cuda   # every variant on the GPU (synchronized timings)
    python benchmarks/dkm_inference.py --only-missing  # the rows a killed (or loaded) run left missing

Three parts, each writing its own results file; every row names the loops (or code) that multiplied, every table
its CPU:
- `loops` (`areas/inference/loops.py`, dkm_inference_loops.json): every loop level of the packed layers' CPU kernel
  this CPU has, each forced in turn: one packed layer against `F.linear` and the time to stream its bytes, and the
  issue's random Llama (hidden 1,024, 4 layers) at 2-4 bits, with and without block scales, bf16 and fp32, against
  dense bf16 / fp32; and the prefill switch (`areas/inference/switch.py`: from how many tokens a packed layer's
  product is faster decoded and multiplied by one GEMM than fused, per shape; whether `MAX_FUSED_TOKENS` agrees).
- `real` (`areas/inference/real.py`, dkm_inference_real.json): the real SmolLM2-135M-Instruct, dense, ours at 3 and 4
  bits with its tied embedding / LM head clustered at 8 bits, bitsandbytes nf4, and llama.cpp on the same weights
  (the shipped Q4_1 file, and the Q4_0 and K-quant files it makes); prefill time and where a token's time goes;
  the verdicts: ours at 4 bits at least as fast as llama.cpp's Q4_0 on one thread, at 3 bits within 10% of every
  llama.cpp file.
- `peers` (dkm_inference.json): the random-weight bf16 Llama of `SHAPES` (details in `areas/inference/variants.py`):
  dense fp32 and bf16; ours, `DKMConfig` at 3 and 4 bits, with and without `scale_block_size=64`, a table per tensor
  and a table per output channel, 16-bit tables (from a short k-means: the speed does not depend on the tables'
  values), saved and reloaded with `from_pretrained` (the compact `PalettizedLinear` layers); peers that run here:
  bitsandbytes nf4, HQQ 3/4-bit g64 (its torch backend), torchao int4 weight-only (where 0.18 has a layout for the
  device) and intx 3/4-bit g64 weight-only, GPTQ 3/4-bit g64 through gptqmodel (its torch kernel).
A peer that cannot run gets its one-line reason in the results file and the table (`bash
benchmarks/install_peers.sh` installs them; llama.cpp: `pip install llama-cpp-python==0.3.36`, built from source).

A peer that crashes (a signal, a nonzero exit), hangs (past 30 minutes) or cannot load is a row with its one-line
reason, and every other row of the part is still measured. Each row is saved to the part's results file as it is
measured, with the 1-minute load it was measured at; `--only-missing` measures only the rows the file lacks (a run
killed half way) or recorded at a load above the core count (marked LOADED in the tables, used by no verdict).
On a CPU that reports AMX, llama.cpp loads without its extra buffer types (`use_extra_bufts=False`: ggml's AMX
path crashed there), which its rows' names say.

Per variant: batch-1 (and in part peers batch-8) greedy `generate` tokens/s (new tokens after a short prompt, after
a warm-up), the time of one prefill forward of 512 tokens, the bytes of the tensors the model holds and the peak
resident memory (`VmHWM`) of loading and of inference. Each variant runs in a fresh process per round (its memory
its own), the variants in an order rotated each round; ratios to dense bf16 are per round
(`areas/inference/runner.py`). Prints the targets' verdict lines. With $HF_LLMKIT_BENCH_LOCK naming a file, the timed
rounds hold a lock on it (the preparation runs before, unlocked). Adding a variant: a dict in a part's plan (`kind`
selects how `areas/inference/variants.py` prepares and loads it, or `areas.inference.worker.measure` measures it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from areas.inference import llamacpp as llama
from areas.inference import loops, real, runner, switch
from areas.inference.report import plot, print_tables, summarize, verdicts
from areas.inference.variants import preimport
from harness import slices
from harness.common import add_device_argument, pick_device, recorded_path

PARTS = ("loops", "real", "peers")
STARTED = time.perf_counter()

SHAPES = {
    "tiny": dict(hidden=128, layers=2, intermediate=384, vocab=4096, heads=4),
    "issue": dict(hidden=1024, layers=8, intermediate=2816, vocab=4096, heads=16),
    "1b": dict(hidden=2048, layers=22, intermediate=5632, vocab=32000, heads=32, kv_heads=4),
}
PER_CHANNEL = dict(granularity="per_grouped_channel", group_size=1)


def ours(bits: int, scales: bool, per_channel: bool) -> tuple[str, dict]:
    options = dict(lut_dtype="bfloat16", kmeans_iters=5, kmeans_sample=4096)  # the speed does not depend on the
    options.update(dict(scale_block_size=64) if scales else {})  # tables' values: a short k-means fits them
    options.update(PER_CHANNEL if per_channel else {})
    label = ", ".join(["a table per channel" if per_channel else "a table per tensor"] + ["scales/64"] * scales)
    return f"ours DKM {bits}-bit ({label})", dict(kind="ours", bits=bits, options=options)


DENSE = {
    "dense fp32": dict(kind="dense", dtype="float32", bits=32),
    "dense bf16": dict(kind="dense", dtype="bfloat16", bits=16),
}
PEERS = {
    "bitsandbytes nf4": dict(kind="bnb", bits=4),
    "HQQ 3-bit g64": dict(kind="hqq", bits=3),
    "HQQ 4-bit g64": dict(kind="hqq", bits=4),
    "torchao int4 g64 weight-only": dict(kind="torchao_int4", bits=4),
    "torchao intx 3-bit g64 weight-only": dict(kind="torchao_intx", bits=3),
    "torchao intx 4-bit g64 weight-only": dict(kind="torchao_intx", bits=4),
    "GPTQ 3-bit g64 (gptqmodel)": dict(kind="gptq", bits=3),
    "GPTQ 4-bit g64 (gptqmodel)": dict(kind="gptq", bits=4),
}

ONNX_OPTIONS = dict(lut_dtype="bfloat16", kmeans_iters=5, kmeans_sample=4096)
ONNX = {  # onnxruntime serving the exports (areas/inference/onnxrt.py); the standard-op path times 2 tokens per call
    "onnxruntime dense fp32 export": dict(kind="onnx", bits=3, options=ONNX_OPTIONS, onnx_file="dense",
                                          onnx_kernel=False),
    "onnxruntime DKM 3-bit, standard ops": dict(kind="onnx", bits=3, options=ONNX_OPTIONS, onnx_file="packed",
                                                onnx_kernel=False, onnx_tokens=2),
    "onnxruntime DKM 3-bit, our kernel": dict(kind="onnx", bits=3, options=ONNX_OPTIONS, onnx_file="packed",
                                              onnx_kernel=True),
}  # fmt: skip


def plan(size: str, quick: bool) -> dict[str, dict]:
    """The variants run at one size: everything at the issue's size; at ~1B the ones whose preparation fits the
    run (no fp32, no GPTQ: quantizing 1B weights on two CPU cores takes longer than the whole run)."""
    mine = dict(ours(b, s, c) for b in (3, 4) for c in (False, True) for s in (False, True))
    if quick:
        keep = [
            "dense bf16",
            "ours DKM 3-bit (a table per tensor)",
            "ours DKM 4-bit (a table per channel, scales/64)",
            "bitsandbytes nf4",
            "HQQ 4-bit g64",
            "torchao int4 g64 weight-only",
            "GPTQ 4-bit g64 (gptqmodel)",
        ]
        quick_onnx = {k: v for k, v in ONNX.items() if v["onnx_kernel"]}  # dkm_onnx.py --quick runs all three
        return {k: v for k, v in (DENSE | mine | PEERS).items() if k in keep} | quick_onnx
    if size == "issue":  # 6 of the 8 ours cells: each costs minutes to quantize on a shared 2-core machine
        return {k: v for k, v in (DENSE | mine | PEERS).items() if k not in ISSUE_LEFT_OUT} | ONNX
    if size == "1b":
        keep = [
            "dense bf16",
            "ours DKM 3-bit (a table per tensor)",
            "ours DKM 3-bit (a table per tensor, scales/64)",
            "ours DKM 4-bit (a table per tensor)",
            "ours DKM 4-bit (a table per tensor, scales/64)",
            "bitsandbytes nf4",
            "HQQ 3-bit g64",
            "HQQ 4-bit g64",
            "torchao intx 4-bit g64 weight-only",
        ]
        return {k: v for k, v in (DENSE | mine | PEERS).items() if k in keep}
    return DENSE | mine | PEERS


ISSUE_LEFT_OUT = ("ours DKM 3-bit (a table per channel, scales/64)", "ours DKM 4-bit (a table per channel)")
NOT_RUN_AT_1B = {
    "dense fp32": "not run at ~1B: 4.4 GB of fp32 weights, over the per-process memory this shared machine allows",
    "GPTQ 3-bit g64 (gptqmodel)": "not run at ~1B: GPTQ of 1B weights on two CPU cores takes longer than the run",
    "GPTQ 4-bit g64 (gptqmodel)": "not run at ~1B: GPTQ of 1B weights on two CPU cores takes longer than the run",
}


def stored_entry(name: str, args, cpu: str) -> dict | None:
    """With --only-missing, this CPU's entry of a per-CPU results file ({} where there is none); None without."""
    return slices.read_results(name).get("machines", {}).get(cpu, {}) if args.only_missing else None


def run_size(size: str, args, device: str, work: Path, results: dict) -> dict:
    """Part `peers`, one size: the random Llama written once, then every variant of `plan` prepared and timed; the
    results file rewritten after every row (`save_peers`)."""
    shape, variants = SHAPES[size], plan(size, args.quick)
    dense_dir = work / size / "dense"
    common = dict(
        shape=shape,
        dense_dir=str(dense_dir),
        device=device,
        prompt=args.prompt,
        new_tokens=args.new_tokens[size],
        prefill=args.prefill,
        repeats=args.repeats,
    )
    runner.child("prepare", dict(common, kind="checkpoint", name="dense checkpoint", dir=str(dense_dir)), work, 3600)
    skipped = {k: v for k, v in NOT_RUN_AT_1B.items() if size == "1b" and not args.quick}
    meta = {"shape": shape, "not_run": skipped, "new_tokens": args.new_tokens[size]}
    stored = results["sizes"].get(size, {}) if args.only_missing else None
    save = lambda part: save_peers(results, size, {**part, **meta})  # noqa: E731
    part = runner.run_part(size, variants, common, args, work, args.threads, args.rounds[size], stored=stored,
                           save=save)  # fmt: skip
    save(part)
    return {**part, **meta}


def save_peers(results: dict, size: str, entry: dict) -> Path:
    """dkm_inference.json as it stands: every size measured so far, summarized, and the verdicts."""
    summarize(entry)
    results["sizes"][size] = entry
    results["verdicts"] = verdicts(results)
    results["seconds"] = time.perf_counter() - STARTED
    return slices.update_results("dkm_inference", {(key,): value for key, value in results.items()})


def run_loops(args, device: str, work: Path) -> dict:
    """Part `loops`: the kernel table (one process) and the issue's Llama per loop level (fresh processes)."""
    shape = loops.TINY if args.quick else loops.MODEL
    new_tokens = args.new_tokens["issue"]
    dense_dir = work / "loops" / "dense"
    common = dict(shape=shape, dense_dir=str(dense_dir), device=device, prompt=args.prompt, new_tokens=new_tokens,
                  prefill=loops.PREFILL, repeats=args.repeats, batch8=False)  # fmt: skip
    cpu = loops.cpu_name()
    stored = stored_entry("dkm_inference_loops", args, cpu)
    runner.child("prepare", dict(common, kind="checkpoint", name="dense checkpoint", dir=str(dense_dir)), work, 3600)
    kernels = (stored or {}).get("kernels")
    if not (kernels and slices.present(kernels) and kernels.get("quick") == args.quick):  # the kernel table's rows
        before = slices.load_1min()
        kernels = runner.child("kernels", dict(name="kernel table", quick=args.quick, device=device), work, 3600)
        kernels.update(quick=args.quick, **slices.stamp(before))
    prefill_switch = (stored or {}).get("switch")
    if not (prefill_switch and slices.present(prefill_switch) and prefill_switch.get("quick") == args.quick):
        before = slices.load_1min()
        spec = dict(name="prefill switch", quick=args.quick, device=device)
        prefill_switch = runner.child("switch", spec, work, 3600)
        prefill_switch.update(quick=args.quick, **slices.stamp(before))
    rounds = 1 if args.quick else args.rounds["issue"]
    meta = dict(cpu=cpu, kernels=kernels, switch=prefill_switch, shape=shape, new_tokens=new_tokens)
    save = lambda part: save_part("dkm_inference_loops", {**part, **meta}, loops.verdicts)  # noqa: E731
    part = runner.run_part("loops", loops.model_plan(args.quick), common, args, work, [1], rounds, stored=stored,
                           save=save)  # fmt: skip
    return save_part("dkm_inference_loops", {**part, **meta}, loops.verdicts)


def run_real(args, device: str, work: Path) -> dict:
    """Part `real`: SmolLM2-135M (a two-layer slice with --quick) against llama.cpp, at each thread count."""
    setup = runner.child("real_setup", dict(name="SmolLM2 folder", quick=args.quick, device=device,
                                            tokens=max(args.prompt, args.prefill)), work, 3600)  # fmt: skip
    new_tokens = args.new_tokens["issue"]
    common = dict(dense_dir=setup["folder"], device=device, prompt=args.prompt, new_tokens=new_tokens,
                  prefill=args.prefill, repeats=args.repeats, text_ids=setup["ids"], shape=None,
                  layers=setup["layers"])  # fmt: skip
    rounds = 1 if args.quick else args.rounds["issue"]
    cpu = loops.cpu_name()
    stored = stored_entry("dkm_inference_real", args, cpu)
    meta = dict(cpu=cpu, new_tokens=new_tokens, layers=setup["layers"], llama_cpp=setup["llama_cpp"])
    variants = real.plan(args.quick, args.compile, extra_bufts=llama.use_extra_bufts())
    save = lambda part: save_part("dkm_inference_real", {**part, **meta}, real.verdicts)  # noqa: E731
    part = runner.run_part("real", variants, common, args, work, args.threads, rounds, stored=stored, save=save)
    return save_part("dkm_inference_real", {**part, **meta}, real.verdicts)


def save_part(name: str, part: dict, judge) -> dict:
    """A part of a per-CPU results file as it stands: summarized, judged (`judge(part)`: its verdict lines), saved."""
    summarize(part)
    part["verdicts"] = judge(part)
    runner.save_per_cpu(name, part, sys.argv[1:])
    return part


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, one round, a few variants")
    parser.add_argument("--sizes", nargs="*", choices=list(SHAPES), default=None, help="(default: issue 1b)")
    parser.add_argument("--threads", nargs="*", type=int, default=[1], help="torch threads (default: 1)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds at the issue's size (~1B: one round fewer)")
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats per process, after a warm-up")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated (~1B: a quarter)")
    parser.add_argument("--prefill", type=int, default=512, help="tokens of the prefill forward")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens before generating")
    parser.add_argument("--jobs", type=int, default=2, help="checkpoints prepared at once (untimed; default: 2)")
    parser.add_argument("--parts", nargs="*", choices=PARTS, default=list(PARTS), help="(default: all)")
    parser.add_argument("--compile", action="store_true", help="part real: also a static cache + torch.compile row")
    slices.add_only_missing_argument(parser)
    add_device_argument(parser)
    args = parser.parse_args()
    device = pick_device(args.device).type
    if min([*args.threads, args.rounds, args.repeats, args.new_tokens, args.jobs]) < 1:
        parser.error("--threads, --rounds, --repeats, --new-tokens and --jobs must be at least 1")
    sizes = args.sizes or (["tiny"] if args.quick else ["issue", "1b"])
    if args.quick:
        args.new_tokens, args.prefill, args.prompt, args.rounds = 4, 32, 8, 1
    args.rounds = {s: max(1, args.rounds - (s == "1b")) for s in SHAPES}
    args.new_tokens = {s: max(1, args.new_tokens // (4 if s == "1b" else 1)) for s in SHAPES}
    failures = []
    with tempfile.TemporaryDirectory(prefix="dkm_inference_") as tmp:
        preimported = preimport() if device == "cpu" else {}  # once, for every forked child
        if "loops" in args.parts:
            part = run_loops(args, device, Path(tmp))
            failures += runner.must_run_failures(part)
            print(f"\n### loops ({part['cpu']})\n\n" + loops.kernel_rows(part["kernels"]))
            print("\n" + loops.model_rows(part, "1") + switch.switch_rows(part["switch"]), flush=True)
            print("\n" + "\n".join(part["verdicts"]), flush=True)
            print(f"wrote {slices.results_path('dkm_inference_loops')}", flush=True)
        if "real" in args.parts:
            part = run_real(args, device, Path(tmp))
            failures += runner.must_run_failures(part)
            for threads in part["threads"]:
                print(f"\n### SmolLM2-135M, {threads} thread(s) ({part['cpu']})\n\n" + real.table(part, threads))
            print("\n" + "\n".join(part["verdicts"]), flush=True)
            print(f"wrote {slices.results_path('dkm_inference_real')}", flush=True)
        if "peers" in args.parts:
            run_peers(args, device, Path(tmp), sizes, preimported, failures)
    if failures:  # every row is written: the run fails after it, naming what must run and did not
        raise SystemExit("error: dense / ours rows did not run:\n" + "\n".join(failures))


def run_peers(args, device: str, work: Path, sizes: list[str], preimported: dict, failures: list[str]) -> None:
    """Part `peers`: every size of `sizes` (with --only-missing, completing the file's own sizes where it was
    measured on this CPU and device), then the tables, the verdicts and the plot."""
    cpu = loops.cpu_name()
    stored = slices.read_results("dkm_inference")
    config = {"prompt": args.prompt, "prefill": args.prefill, "repeats": args.repeats, "threads": args.threads}
    here = {"cpu": cpu, "device": device}
    results: dict = {
        "argv": sys.argv[1:],
        **here,
        "config": config,
        "preimported": preimported,
        "sizes": slices.kept_sizes("dkm_inference", stored, here, config, sizes, args.only_missing, loose=()),
    }
    for size in sizes:
        part = run_size(size, args, device, work, results)
        failures += runner.must_run_failures(part)
    print_tables(results)
    print("\n" + "\n".join(results["verdicts"]))
    path = plot(results)
    results["plots"] = [recorded_path(path)] if path else []
    out = save_peers(results, sizes[-1], results["sizes"][sizes[-1]])
    print(f"\nwrote {out} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
