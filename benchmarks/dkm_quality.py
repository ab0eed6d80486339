"""Quality per bit: DKM against real peers at 2, 3 and 4 bits per weight, on real weights (issues 20, 32, 43).

    bash benchmarks/install_peers.sh          # once: torchao, HQQ, llmcompressor (GPTQ) beside our pins
    python benchmarks/dkm_quality.py          # both workloads (tens of minutes on 2 busy cores)
    python benchmarks/dkm_quality.py --quick  # MiniLM at 2 and 4 bits, 1 step, no GPTQ; steps, soft, job: small
    python benchmarks/dkm_quality.py --only smollm2 --bits 3   # the real LLM's table, one width (hours)
    python benchmarks/dkm_quality.py --only smollm2 --bits 4 --data-free   # its cheap rows first (minutes)
    python benchmarks/dkm_quality.py --only calibration        # our calibrated start against GPTQ's time
    python benchmarks/dkm_quality.py --only recipe             # the whole path on the real LLM, stage by stage

The real decoder LLM, SmolLM2-135M-Instruct (`areas/dkm/smollm2.py`, `areas/dkm/real.py`, `areas/dkm/llamacpp.py`,
`areas/dkm/recipe.py`; rendered by `areas/dkm/real_report.py`): perplexity, KL from the source model, top-1 agreement
and the worst block on held-out text, against every peer including llama.cpp's formats; every row is saved as it is
measured, and a run (the same command after a kill, say) measures only the rows the results file does not hold yet,
our calibrated start of each width read from its cache on disk (`--remeasure` measures the chosen rows again,
`--rows TEXT` chooses rows by name, `--data-free` the rows that read no training text).

Workloads (`areas/dkm/workloads.py`): all-MiniLM-L6-v2 (embedding cosine to fp32, mean / worst sentence, Spearman of
pairwise similarities) and a Llama pretrained here by `examples/run_clm.py` (held-out perplexity, worst block's
perplexity ratio to fp32; `--lm-size 22m`, the default, has ~22M parameters, `5m` ~5M). Methods (`areas/dkm/peers.py`),
every Linear but the head quantized:
- ours without training: a k-means table per tensor over weights divided by a 16-bit absmax scale per 64 inputs
  (`scale_block_size=64`), refit by k-means weighted by each weight's share of the output error and GPTQ-rounded
  onto it (`calibration_refit=True`, `calibrate`), on the calibration inputs GPTQ gets;
- trained, the same distillation batches, steps and optimizer each: DKM (ours, `DKMConfig(bits)`), DKM from that
  post-training start (`DKMConfig(recipe="calibrated")`, ours), torchao 0.18 QAT
  (`IntxFakeQuantizeConfig` int2/int3/int4, symmetric, group 64), coremltools `DKMPalettizer` (with `--coreml-dkm`: it
  takes minutes per step here, benchmarks/dkm.py measures it);
- post-training: plain k-means (our tables without training), coremltools `PostTrainingPalettizer` (k-means), HQQ
  (group 64), GPTQ (llmcompressor, group 64, calibrated on training inputs), bitsandbytes nf4 (4.5 bits).
Bits per weight are counted from what each method stores over the quantized matrices: indices or integers plus
lookup tables, scales and zero points. Each row also has its compute time and peak tensor memory. Two sections write
benchmarks/results/dkm_soft.json: `--only steps` (`areas/dkm/steps.py`) times one training step of MiniLM and of
SmolLM2, plain against DKM's (its C kernel, torch's ops, fp32 and bf16 latents), and `--only soft`
(`areas/dkm/soft.py`) trains from the calibrated start with DKM's soft assignment against straight-through training and
measures why one wins.

Writes benchmarks/results/dkm_quality.json and dkm_quality.png (quality against bits per weight, per workload).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
import traceback
from pathlib import Path

from areas.dkm import job as job_section
from areas.dkm import peers, real
from areas.dkm import soft as soft_section
from areas.dkm import steps as steps_section
from areas.dkm.workloads import CALIBRATION_SAMPLES, CausalLM, MiniLM, lm_recipe, make_trainer
from harness.common import (
    RESULTS,
    PeakMemory,
    load_note,
    machine_state,
    markdown_table,
    recorded_path,
    run_record,
    write_results,
)

BITS = (2, 3, 4)
WORKLOAD_SETTINGS = ("steps", "lr", "calibration_samples", "dropout", "machine_before")  # the tables ran with
QUICK_BITS = (2, 4)  # --quick: the 2-bit rows' branch and the 4-bit one (nf4 included), seconds each
RESULTS_PATH = RESULTS / "dkm_quality.json"
LM_DIR = Path.home() / ".cache" / "hf_llmkit" / "dkm_quality_lm"  # + "_<size>"


def save(results: dict) -> Path:
    """Write the results, keeping the sections of an earlier run that this one did not measure (`--only`); the real
    model's rows of the widths this run did not measure (`--bits`) stay too (`areas.dkm.real.merge`)."""
    path = RESULTS_PATH
    with _locked(path):  # two runs of other sections or widths may save at once: read, merge and write as one
        return _merge_into(path, results)


@contextlib.contextmanager
def _locked(path: Path):
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / f"hf_llmkit_{path.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _merge_into(path: Path, results: dict) -> Path:
    earlier = json.loads(path.read_text()) if path.is_file() else {}
    fresh = results
    results = {**earlier, **results, "workloads": {**earlier.get("workloads", {}), **results["workloads"]}}
    if not fresh["workloads"] and not fresh.get("seeds"):  # other sections only: the workloads' settings stay theirs
        results.update({k: earlier[k] for k in WORKLOAD_SETTINGS if k in earlier})
    seeds = {**earlier.get("seeds", {})}
    for name, runs in fresh.get("seeds", {}).items():
        seeds[name] = {**seeds.get(name, {}), **runs}
    if seeds:
        results["seeds"] = seeds
    if "real_model" in fresh:
        results["real_model"] = real.merge(earlier.get("real_model"), fresh["real_model"])
    real_seeds = dict(earlier.get("real_model_seeds", {}))
    for seed, section in fresh.get("real_model_seeds", {}).items():
        real_seeds[seed] = real.merge(real_seeds.get(seed), section)
    if real_seeds:
        results["real_model_seeds"] = real_seeds
    return write_results("dkm_quality", results, path=path)


def tables_per(size: int) -> str:
    return "a table per channel" if size == 1 else f"a table per {size} channels"


def methods(bits: int, args, workload) -> dict[str, tuple]:
    """{name: (function, trained, extra kwargs)} of the methods run at `bits`."""
    size = peers.channels_per_table(workload.load(), bits, workload.skip + args.extra_skip)
    tuned = {"granularity": "per_grouped_channel", "group_size": size, "lut_dtype": "float16", "calibration": None}
    # post-training: a table per tensor, a 16-bit scale per 64 inputs, table refit to the output error, GPTQ rounding
    scaled = {"scale_block_size": 64, "lut_dtype": "float16", "calibration_refit": True, "calibration": None}
    from_start = {"recipe": "calibrated", "calibration": None}  # the same start, then trained (the one setting)
    post = f"DKM {bits}-bit, scales per 64 inputs, refit + calibrated, no training (ours)"
    trained_from = f"DKM {bits}-bit, trained from that start, recipe='calibrated' (ours)"
    if bits == 2:  # where post-training falls apart: ours before and after training, the grouped peers
        out = {post: (peers.dkm, False, scaled), trained_from: (peers.dkm, True, from_start),
               "torchao QAT int2 g64": (peers.torchao_qat, True, {}),
               "HQQ 2-bit g64": (peers.hqq, False, {})}  # fmt: skip
        if not args.quick:
            out["GPTQ 2-bit g64 (llmcompressor)"] = (peers.gptq, False, {"calibration": None})
        return out
    out = {
        post: (peers.dkm, False, scaled),
        trained_from: (peers.dkm, True, from_start),
        f"DKM {bits}-bit, {tables_per(size)}, 16-bit tables, calibrated (ours)": (peers.dkm, True, tuned),
        f"DKM {bits}-bit (ours)": (peers.dkm, True, {}),
        f"k-means {bits}-bit, no training (ours)": (peers.dkm, False, {}),
        f"torchao QAT int{bits} g64": (peers.torchao_qat, True, {}),
        f"torchao QAT int{bits} per channel": (peers.torchao_qat, True, {"group_size": None}),
        f"coremltools k-means {bits}-bit": (peers.coreml_kmeans, False, {}),
        f"HQQ {bits}-bit g64": (peers.hqq, False, {}),
    }  # fmt: skip
    if not args.quick:
        out[f"GPTQ {bits}-bit g64 (llmcompressor)"] = (peers.gptq, False, {"calibration": None})
    if args.coreml_dkm:
        out[f"coremltools DKMPalettizer {bits}-bit"] = (peers.coreml_dkm, True, {})
    if bits == 4:
        out["bitsandbytes nf4"] = (peers.bnb_nf4, False, {})
    return out


def run_workload(workload, args) -> list[dict]:
    train = make_trainer(workload, args.steps, args.lr, args.seed)
    rows = [{"method": "fp32 (reference)", "bits": 32, "bpw": 32.0, **workload.evaluate(workload.teacher)}]
    skip = workload.skip + args.extra_skip
    for bits in args.bits or (QUICK_BITS if args.quick else BITS):
        for name, (fn, trained, extra) in methods(bits, args, workload).items():
            if "calibration" in extra:
                extra = {**extra, "calibration": workload.calibration(16 if args.quick else CALIBRATION_SAMPLES)}
            model = workload.load()
            row = {"method": name, "bits": bits, "trained": trained, "steps": args.steps if trained else 0}
            start = time.perf_counter()
            try:
                with PeakMemory("cpu") as mem:
                    row["bpw"] = fn(model, bits, skip, train if trained else None, **extra)
                row["seconds"] = time.perf_counter() - start
                row["peak_mb"] = mem.peak_bytes / 2**20
                row.update(workload.evaluate(model))
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported with its reason
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                traceback.print_exc(limit=2, file=sys.stderr)
            rows.append(row)
            shown = {k: round(v, 4) for k, v in row.items() if isinstance(v, float)}
            print(f"  {workload.name}: {name}: {shown} {row.get('error', '')}", file=sys.stderr, flush=True)
            del model
    if hasattr(workload, "main_job") and not args.quick and not args.bits and not args.seed:
        rows += [main_job_row(workload, bits, args) for bits in (3, 4)]
    return rows


def main_job_row(workload, bits: int, args) -> dict:
    """DKM as users run it: `run_clm.py --quantization dkm` on the pretrained checkpoint, its saved model reloaded."""
    import tempfile

    size = peers.channels_per_table(workload.load(), bits, workload.skip + args.extra_skip)
    options = ["--dkm_granularity", "per_grouped_channel", "--dkm_group_size", str(size), "--dkm_lut_dtype", "float16",
               "--dkm_calibration_samples", str(CALIBRATION_SAMPLES)]  # fmt: skip
    name = f"DKM {bits}-bit by run_clm.py, LM loss, no teacher, {tables_per(size)}, calibrated (ours)"
    row = {"method": name, "bits": bits, "trained": True}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dkm_quality_job_") as out:  # the job's time includes its evaluations
        model, row["bpw"], flags = workload.main_job(bits, args.steps, args.lr, Path(out), options)
        row["seconds"] = time.perf_counter() - start
        row.update(workload.evaluate(model))
    row["steps"], row["command"] = args.steps, "python examples/run_clm.py " + " ".join(flags)
    print(f"  {workload.name}: {row['method']}: {row}", file=sys.stderr, flush=True)
    return row


def job_times(args) -> list[dict]:
    """The main job at Llama shapes, DKM against full fine-tuning, each in a fresh process (`areas/dkm/job.py`)."""
    import tempfile

    rows, methods = [], list(job_section.METHODS)[: 2 if args.quick else None]  # --quick: plain and DKM
    if not args.quick:
        with tempfile.TemporaryDirectory(prefix="dkm_quality_job_") as work:  # not recorded: warms the file caches
            job_section.run("tiny", methods[0], Path(work))  # and the tokenized data for the first row
    for shape in args.job_shapes or (["tiny"] if args.quick else ["280M", "1B"]):
        for method in methods:
            with tempfile.TemporaryDirectory(prefix="dkm_quality_job_") as work:  # --quick: forked, not cold
                row = job_section.run(shape, method, Path(work), fork=args.quick)
            shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
            print(f"  job: {shown}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def recipe_section(args) -> dict:
    """The whole path on the real model (`areas/dkm/recipe.py`; --quick: its two-layer slice, two steps a job)."""
    import tempfile

    from areas.dkm import recipe

    from hf_llmkit.testing import smollm2_path

    model = str(smollm2_path(num_hidden_layers=2 if args.quick else None))
    with tempfile.TemporaryDirectory(prefix="dkm_recipe_") as work:
        section = recipe.run(model, Path(work), quick=args.quick)
    for stage in section["stages"]:
        print(f"  recipe: {stage}", file=sys.stderr, flush=True)
    return {**section, "model": Path(model).name, "measured": run_record()}


def print_table(name: str, metrics: tuple[str, ...], rows: list[dict]) -> None:
    head = ["method", "bits/weight", *metrics, "seconds", "peak MB"]
    table = [head]
    for r in rows:
        if "error" in r:
            table.append([r["method"], "-", *(["-"] * len(metrics)), "-", r["error"][:60]])
            continue
        vals = [f"{r[m]:.4f}" if m != "ppl" else f"{r[m]:.2f}" for m in metrics]
        table.append(
            [r["method"], f"{r['bpw']:.3f}", *vals, f"{r.get('seconds', 0):.0f}", f"{r.get('peak_mb', 0):.0f}"]
        )
    print(f"\n### {name}\n\n{markdown_table(table)}")


def plot(results: dict) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from harness.common import save_figure

    panels = [(w, r) for w, r in results["workloads"].items() if r["rows"]]
    if not panels:  # a run of another seed only: nothing for the main plot
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, (name, res) in zip(axes[0], panels):
        metric = res["metrics"][0]
        for r in res["rows"]:
            if "error" in r or r["bpw"] > 8:
                continue
            ours = "ours" in r["method"]
            ax.scatter(r["bpw"], r[metric], marker="*" if ours else "o", s=120 if ours else 50)
            ax.annotate(r["method"], (r["bpw"], r[metric]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.axhline(res["rows"][0][metric], color="gray", linestyle=":", label="fp32")
        ax.set_xlabel("bits per weight (tables, scales and zeros included)")
        ax.set_ylabel(metric + (" (lower is better)" if metric == "ppl" else " (higher is better)"))
        ax.set_title(name, fontsize=9)
        if metric == "ppl":
            ax.set_yscale("log")
    return save_figure(fig, "dkm_quality", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="one MiniLM matrix, 2 and 4 bits, 1 step, no GPTQ; sections minilm, steps (MiniLM's "
                             "matrix and a 2-layer SmolLM2, 1 round), soft (MiniLM, the 2 variants the verdict "
                             "compares) and job (tiny)")  # fmt: skip
    parser.add_argument("--device", default="cpu", choices=["cpu"], help="CPU only (the peers' CPU paths)")
    parser.add_argument("--steps", type=int, default=None, help="training steps of every trained method")
    parser.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate of every trained method")
    parser.add_argument(
        "--only",
        nargs="*",
        choices=["minilm", "lm", "steps", "job", "soft", "smollm2", "calibration", "recipe"],
        default=None,
        help="sections (default: all but soft and the real model's smollm2, calibration and recipe; --quick: "
        "minilm, steps, soft and job)",
    )
    parser.add_argument("--calibration-rounds", type=int, default=2, help="rounds of the calibration-cost section")
    parser.add_argument("--lm-dir", type=Path, default=None, help="pretrained causal LM (trained there if missing)")
    parser.add_argument("--lm-size", default="22m", choices=["22m", "5m"], help="the causal LM's size")
    parser.add_argument("--lm-pretrain-steps", type=int, default=300, help="steps of the causal LM's pretraining")
    parser.add_argument("--coreml-dkm", action="store_true", help="also train coremltools' DKMPalettizer (slow)")
    parser.add_argument("--step-rounds", type=int, default=None,
                        help="timed rounds of the step-time section (default 3; --quick: 1)")  # fmt: skip
    parser.add_argument("--step-threads", type=int, default=1, help="torch threads of the step-time section")
    soft_section.add_arguments(parser)
    parser.add_argument("--job-shapes", nargs="*", default=None, choices=list(job_section.SHAPES),
                        help="the job section's Llama shapes (default 280M and 1B; --quick: tiny)")  # fmt: skip
    parser.add_argument("--bits", type=int, nargs="*", choices=BITS, default=None, help="only these widths")
    parser.add_argument("--rows", nargs="*", default=None, metavar="TEXT",
                        help="smollm2: only the rows whose name holds one of these (case-insensitive)")  # fmt: skip
    parser.add_argument("--data-free", action="store_true",
                        help="smollm2: only the rows that read no training text (llama.cpp, HQQ, torchao PTQ, "
                             "coremltools k-means, nf4): minutes, where ours and GPTQ take tens")  # fmt: skip
    parser.add_argument("--remeasure", action="store_true",
                        help="smollm2: measure the chosen rows again (by default a run measures only the rows the "
                             "results file lacks under the same settings, so a killed run resumes)")  # fmt: skip
    parser.add_argument("--new-table", action="store_true",
                        help="smollm2: measure a new table in place of the rows the results file holds (other "
                             "settings); without it a run with other settings is refused")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0,
                        help="another order of the training data and calibration samples; a seed other than 0 "
                             "is kept beside the main tables (the seed-spread table), not in them")  # fmt: skip
    args = parser.parse_args()
    args.steps = args.steps if args.steps is not None else (1 if args.quick else 40)
    args.step_rounds = args.step_rounds if args.step_rounds is not None else (1 if args.quick else 3)
    # --quick: only the first encoder layer's intermediate.dense is quantized (everything else is skipped)
    quick_skip = [f"layer.{i}.{s}" for i in range(6) for s in _BERT_LINEARS if (i, s) != (0, "intermediate.dense")]
    args.extra_skip = tuple(quick_skip) if args.quick else ()
    sections = args.only or (["minilm", "steps", "soft", "job"] if args.quick else ["minilm", "lm", "steps", "job"])
    logging.getLogger("llmcompressor").setLevel(logging.ERROR)
    results = {
        "machine_before": machine_state(),
        "steps": args.steps,
        "lr": args.lr,
        "workloads": {},
        "calibration_samples": CALIBRATION_SAMPLES,
        "dropout": 0,
    }  # fmt: skip (make_trainer turns dropout off)
    start = time.perf_counter()

    def keep(name: str, section: dict) -> None:
        """A finished workload's section goes into the results at once (a seed other than 0: beside them)."""
        if args.seed:
            results.setdefault("seeds", {})[name] = {str(args.seed): section}
        else:
            results["workloads"][name] = section
        save(results)

    if "minilm" in sections:
        w = MiniLM(quick=args.quick, seed=args.seed)
        rows = run_workload(w, args)
        keep(w.name, {
            "metrics": w.metrics,
            "rows": rows,
            "held_out": len(w.held_out),
            "measured": run_record(),  # when, by which command (kept by a later --only run)
        })  # fmt: skip
        print_table(w.name, w.metrics, rows)
    if "lm" in sections:
        lm_dir = args.lm_dir or LM_DIR.with_name(f"{LM_DIR.name}_{args.lm_size}")
        model_dir = CausalLM.ensure(lm_dir, args.lm_pretrain_steps, args.lm_size)
        w = CausalLM(model_dir, quick=args.quick, seed=args.seed)
        rows = run_workload(w, args)
        flags = lm_recipe(Path("<dir>"), args.lm_pretrain_steps, args.lm_size)
        params = sum(p.numel() for p in w.teacher.parameters())
        w.name = f"{w.name} ({params / 1e6:.1f}M parameters)"
        keep(w.name, {
            "metrics": w.metrics,
            "rows": rows,
            "recipe": "python examples/run_clm.py " + " ".join(flags),
            "eval_blocks": len(w.val),
            "measured": run_record(),  # when, by which command (kept by a later --only run)
        })  # fmt: skip
        print_table(w.name, w.metrics, rows)
    if "steps" in sections:  # its own results file, dkm_soft.json (`areas/dkm/steps.py`)
        soft_section.save_section("steps", steps_section.step_times(args, MiniLM))
    if "soft" in sections:  # soft assignment against straight-through training (`areas/dkm/soft.py`)
        soft_section.save_section("study", soft_section.study(args))  # each workload also as it finishes
    if "smollm2" in sections:

        def keep_real(section: dict) -> None:  # after every row: a long run keeps what it measured
            if args.seed:
                results["real_model_seeds"] = {str(args.seed): section}
            else:
                results["real_model"] = section
            save(results)

        with _locked(RESULTS_PATH):
            held = json.loads(RESULTS_PATH.read_text()) if RESULTS_PATH.is_file() else {}
        stored = held.get("real_model_seeds", {}).get(str(args.seed)) if args.seed else held.get("real_model")
        keep_real(real.run(args, keep_real, stored))
    if "recipe" in sections:
        results["real_model_recipe"] = recipe_section(args)
        save(results)
    if "calibration" in sections:
        results["real_model_calibration"] = real.calibration_cost(args)
        save(results)
    if "job" in sections:
        results["job_times"] = {"rows": job_times(args), "measured": run_record()}
        save(results)
    results["machine_after"] = machine_state()
    results["seconds"] = time.perf_counter() - start
    out = save(results)
    with _locked(out):  # the plots of what the file holds now (another run may have saved rows meanwhile)
        results = json.loads(out.read_text())
        drawn = plot(results)
        results["plot"] = recorded_path(drawn) if drawn else None
        if results.get("real_model"):
            drawn = real.plot(results["real_model"])
            results["real_model"]["plot"] = recorded_path(drawn) if drawn else None
        out = write_results("dkm_quality", results)
    print(f"\n{load_note(results['machine_before'], results['machine_after'])}; wrote {out}")


_BERT_LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                 "intermediate.dense", "output.dense")  # fmt: skip

if __name__ == "__main__":
    main()
