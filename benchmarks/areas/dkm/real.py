"""The real-model sections of dkm_quality.py (issue 43): `smollm2` (the quality table) and `calibration` (its cost).

`smollm2`, per index width: ours as a post-training start (`DKMConfig(scale_block_size=64, lut_dtype="float16",
calibration_refit=True)` + `calibrate`: what `recipe="calibrated"` starts from), ours trained from that start
(`recipe="calibrated"`: straight-through training of the latent weights on the start's tables and scales), eDKM's own
soft-assignment training from the very same start (its latent weights, tables and scales copied: DKM's attention
over the table and its centroid iterations, `dkm_iters=3`), and the peers: GPTQ (llmcompressor), torchao QAT and
weight-only PTQ, HQQ, coremltools k-means, bitsandbytes nf4 (4 bits) and llama.cpp's K-quants
(`areas/dkm/llamacpp.py`). Every trained method runs the same distillation steps on the same batches (`make_trainer`;
the decoder's Linear layers train, the tied embedding stays). No method quantizes the embedding / tied LM head; the
eDKM paper's 8-bit clustering of it is measured on its own (`embedding_rows`). A seed other than 0 reruns the methods
that read the training text (calibration samples, training batches); the data-free ones give the same model at every
seed.

`calibration`: the wall time of our calibrated start of the whole model (table initialisation, refit and GPTQ
rounding onto the tables) against llmcompressor's GPTQ on the same model and calibration samples, in rounds whose
order alternates, a fresh model each time.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from harness.common import Timings, machine_state, run_record

from areas.dkm import llamacpp, peers
from areas.dkm.smollm2 import TRAIN_BATCH, TRAIN_TOKENS, SmolLM2, cluster_embedding
from areas.dkm.workloads import make_trainer

BITS = (2, 3, 4)
START = {"scale_block_size": 64, "lut_dtype": "float16", "calibration_refit": True}  # recipe="calibrated"'s start
EMBEDDING_BITS = 8
EMBEDDING_WIDTH = 3  # the width whose trained model is also measured with its embedding clustered


def _names(bits: int) -> dict[str, str]:
    return {
        "start": f"DKM {bits}-bit, scales per 64 inputs, refit + calibrated, no training (ours)",
        "trained": f"DKM {bits}-bit, trained from that start, recipe='calibrated' (ours)",
        "soft": f"eDKM {bits}-bit, soft-assignment training from that start (ours)",
    }


def peer_plan(bits: int, quick: bool) -> dict[str, tuple]:
    """{name: (function, trained, data_free, extra kwargs)} of the peers at `bits`."""
    plan = {} if quick else {f"GPTQ {bits}-bit g64 (llmcompressor)": (peers.gptq, False, False, {"calibration": None})}
    plan[f"torchao QAT int{bits} g64"] = (peers.torchao_qat, True, False, {})
    plan[f"torchao int{bits} g64 asymmetric, weight-only PTQ"] = (peers.torchao_ptq, False, True, {})
    plan[f"HQQ {bits}-bit g64"] = (peers.hqq, False, True, {})
    plan[f"coremltools k-means {bits}-bit"] = (peers.coreml_kmeans, False, True, {})
    if bits == 4:
        plan["bitsandbytes nf4"] = (peers.bnb_nf4, False, True, {})
    return plan


def _measure(workload, name: str, bits: int, trained: bool, steps: int, fn) -> tuple[dict, object]:
    """One row: `fn()` returns (model, bits per weight); then the model's metrics. (row, model or None)."""
    row = {"method": name, "bits": bits, "trained": trained, "steps": steps if trained else 0}
    model = None
    start, cpu = time.perf_counter(), time.process_time()
    try:  # timed without PeakMemory: its per-operator hook would dominate GPTQ-style column loops
        model, row["bpw"] = fn()
        row["seconds"], row["cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
        row.update(workload.evaluate(model))
    except Exception as exc:  # noqa: BLE001 - a method that cannot run here is reported with its reason
        row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        traceback.print_exc(limit=3, file=sys.stderr)
    shown = {k: round(v, 4) for k, v in row.items() if isinstance(v, float)}
    print(f"  {workload.name}: {name}: {shown} {row.get('error', '')}", file=sys.stderr, flush=True)
    return row, model


def width_rows(workload, bits: int, args, train, calibration, rows: list, extra: list, keep) -> None:
    """The table's rows at `bits` and the embedding rows measured on top of our trained model, appended to `rows`
    and `extra`; `keep()` after each (a long run keeps what it measured)."""
    skip, names = workload.skip, _names(bits)
    state = {}

    def start():
        model = workload.load()
        bpw = peers.dkm(model, bits, skip, None, calibration=calibration, **START)
        state["start"] = peers.dkm_state(model)
        return model, bpw

    def from_start(options):
        def run():
            model = workload.load()
            return model, peers.dkm(model, bits, skip, train, start=state["start"], **options)

        return run

    row, model = _measure(workload, names["start"], bits, False, args.steps, start)
    rows.append(row)
    keep()
    del model  # its state is kept: the trained rows start from it
    if "start" in state:
        row, model = _measure(workload, names["trained"], bits, True, args.steps, from_start({"recipe": "calibrated"}))
        rows.append(row)
        keep()
        if model is not None and "error" not in row and bits == EMBEDDING_WIDTH and not args.quick:
            emb = cluster_embedding(model, EMBEDDING_BITS)
            method = f"{names['trained']} + embedding / tied LM head {EMBEDDING_BITS}-bit k-means"
            extra.append({"method": method, "bits": bits, "bpw": row["bpw"], "embedding_bpw": emb,
                          **workload.evaluate(model)})  # fmt: skip
            keep()
        del model
        rows.append(_measure(workload, names["soft"], bits, True, args.steps, from_start(START))[0])
        keep()
    for name, (fn, trained, data_free, kwargs) in peer_plan(bits, args.quick).items():
        if args.seed and data_free:
            continue  # the same model at every seed

        def run(fn=fn, trained=trained, kwargs=kwargs):
            model = workload.load()
            kwargs = {**kwargs, "calibration": calibration} if "calibration" in kwargs else kwargs
            return model, fn(model, bits, skip, train if trained else None, **kwargs)

        row = _measure(workload, name, bits, trained, args.steps, run)[0]
        rows.append({**row, "data_free": data_free})
        keep()


def run(args, keep=lambda section: None) -> dict:
    """The `smollm2` section: every width of `args.bits`, the llama.cpp rows, the embedding rows; `keep(section)`
    after each row."""
    workload = make_workload(args)
    train = make_trainer(workload, args.steps, args.lr, args.seed)
    calibration = workload.calibration()
    widths = args.bits or ((2,) if args.quick else BITS)
    rows, extra, tokenizer = [], [], {}
    save = lambda: keep(_section(workload, args, rows, extra, tokenizer.get("check")))  # noqa: E731
    if not args.seed:
        rows.append({"method": "fp32 (reference)", "bits": 32, "bpw": 32.0, **workload.reference_metrics()})
        if not args.quick and EMBEDDING_WIDTH in widths:
            model = workload.load()
            emb = cluster_embedding(model, EMBEDDING_BITS)
            extra.append({"method": f"source decoder + embedding / tied LM head {EMBEDDING_BITS}-bit k-means (ours)",
                          "bits": 32, "bpw": 32.0, "embedding_bpw": emb, **workload.evaluate(model)})  # fmt: skip
            del model
        save()
    for bits in widths:
        width_rows(workload, bits, args, train, calibration, rows, extra, save)
    if not args.quick and not args.seed:
        if llamacpp.available() is None:
            tokenizer["check"] = llamacpp.tokenizer_check(workload.eval_text, workload.eval_ids)
        with tempfile.TemporaryDirectory(prefix="dkm_llamacpp_") as work:
            for row in llamacpp.rows(workload, widths, torch.get_num_threads(), Path(work), source=4 in widths):
                rows.append({**row, "data_free": True})
                save()
    return _section(workload, args, rows, extra, tokenizer.get("check"))


def _section(workload, args, rows: list, extra: list, tokenizer: dict | None) -> dict:
    teacher = workload.teacher
    return {
        "model": workload.name,
        "parameters": sum(p.numel() for p in teacher.parameters()),
        "layers": teacher.config.num_hidden_layers,
        "quantized_parameters": sum(m.weight.numel() for m in peers.linears(teacher, workload.skip).values()),
        "split": workload.split,
        "block": workload.block,
        "calibration": list(workload.calibration_shape),
        "train_batch": [TRAIN_BATCH, TRAIN_TOKENS],
        "metrics": list(workload.metrics),
        "steps": args.steps,
        "lr": args.lr,
        "rows": list(rows),
        "embedding_rows": list(extra),
        "llama_cpp_tokenizer": tokenizer,
        "measured": run_record(),
    }


def make_workload(args) -> SmolLM2:
    if args.quick:  # a 2-layer slice, 2 blocks of 128 tokens, 8 calibration windows of 64
        return SmolLM2(layers=2, blocks=2, block=128, seed=args.seed, calibration_samples=8, calibration_tokens=64)
    return SmolLM2(seed=args.seed)


def calibration_cost(args, bits: int = 3) -> dict:
    """Our calibrated start against llmcompressor's GPTQ on the same model and samples, `args.rounds` rounds."""
    from hf_llmkit import DKMConfig
    from hf_llmkit.quantization import calibrate, quantize_model

    workload = make_workload(args)
    calibration = workload.calibration()
    ours = "ours: the calibrated start (k-means tables, refit, GPTQ rounding onto them)"
    gptq = f"GPTQ {bits}-bit g64 (llmcompressor)"

    def our_start(model):
        quantize_model(model, DKMConfig(bits=bits, modules_to_not_convert=list(workload.skip), **START))
        calibrate(model, peers._rows(calibration))

    variants = {ours: our_start, gptq: lambda model: peers.gptq(model, bits, workload.skip, calibration=calibration)}
    seconds, cpu = {name: [] for name in variants}, {name: [] for name in variants}
    before = machine_state()
    for round_index in range(args.calibration_rounds):
        names = list(variants)[round_index % 2 :] + list(variants)[: round_index % 2]
        for name in names:
            model = workload.load()
            start, used = time.perf_counter(), time.process_time()
            variants[name](model)
            seconds[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - used)
            print(f"  calibration cost: {name}: {seconds[name][-1]:.1f} s, CPU {cpu[name][-1]:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            del model
    timings = Timings(seconds, gptq, before, machine_state())
    ratios = timings.ratios[ours]
    cpu_ratios = [a / b for a, b in zip(cpu[ours], cpu[gptq])]
    return {**timings.to_json(), "cpu_seconds": cpu, "ours": ours, "peer": gptq, "bits": bits,
            "samples": list(workload.calibration_shape), "torch_threads": torch.get_num_threads(),
            "ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "cpu_ratio_min": min(cpu_ratios),
            "cpu_ratio_median": statistics.median(cpu_ratios), "measured": run_record()}  # fmt: skip


def merge(earlier: dict | None, new: dict) -> dict:
    """A section measured again over part of the widths (`--bits`): the new rows replace the earlier rows of the
    same methods, the others stay; `runs` lists every run that wrote rows (its command and date)."""
    if not earlier:
        return {**new, "runs": [new["measured"]]}
    out = {**earlier, **{k: v for k, v in new.items() if k not in ("rows", "embedding_rows", "llama_cpp_tokenizer")}}
    for key in ("rows", "embedding_rows"):
        fresh = {r["method"] for r in new[key]}
        rows = [r for r in earlier.get(key, []) if r["method"] not in fresh] + new[key]
        out[key] = sorted(rows, key=lambda r: (r["bits"] != 32, r["bits"]))  # stable: each width keeps its order
    out["llama_cpp_tokenizer"] = new.get("llama_cpp_tokenizer") or earlier.get("llama_cpp_tokenizer")
    run = new["measured"]  # a run saves after every row: its latest record replaces its earlier ones
    same = lambda r: (r.get("command"), r.get("started")) == (run.get("command"), run.get("started"))  # noqa: E731
    out["runs"] = [*(r for r in earlier.get("runs", []) if not same(r)), run]
    return out


def plot(section: dict):
    """KL from the source and perplexity against bits per weight, one point per row (ours as stars):
    benchmarks/results/dkm_quality_smollm2.png; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from harness.common import save_figure

    rows = [r for r in section["rows"] if "error" not in r and r["bits"] != 32]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, metric in zip(axes, ("kl", "ppl")):
        for r in rows:
            ours = "(ours)" in r["method"]
            ax.scatter(r["bpw"], r[metric], marker="*" if ours else "o", s=120 if ours else 40)
            ax.annotate(r["method"][:48], (r["bpw"], r[metric]), fontsize=5, xytext=(3, 3), textcoords="offset points")
        if metric == "ppl":
            ax.axhline(section["rows"][0]["ppl"], color="gray", linestyle=":", label="source")
        ax.set_xlabel("bits per weight over the decoder's Linear weights (tables, scales and zeros included)")
        ax.set_ylabel(("KL(source || method) per token" if metric == "kl" else "perplexity") + " (lower is better)")
        ax.set_yscale("log")
        ax.set_title(f"{section['model']}, held-out text", fontsize=9)
    return save_figure(fig, "dkm_quality_smollm2", dpi=120)
