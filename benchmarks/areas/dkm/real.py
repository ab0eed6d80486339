"""The real-model sections of dkm_quality.py (issue 43): `smollm2` (the quality table) and `calibration` (its cost).

`smollm2`, per index width: ours as a post-training start (`DKMConfig(scale_block_size=64, lut_dtype="float16",
calibration_refit=True)` + `calibrate`: what `recipe="calibrated"` starts from), ours trained from that start
(`recipe="calibrated"`: straight-through training of the latent weights on the start's tables and scales), eDKM's own
soft-assignment training from the very same start (its latent weights, tables, scales and input importance copied:
DKM's attention over the table and its centroid iterations, `dkm_iters=3`, weighted by that importance), and the
peers: GPTQ (llmcompressor, groups of 64 and 128), torchao QAT and weight-only PTQ, HQQ, coremltools k-means,
bitsandbytes nf4 (4 bits) and llama.cpp's formats (`areas/dkm/llamacpp.py`). Resumable (issue 51): every row is saved
as it is measured, a run measures only the rows the results file lacks (`Table`), and the calibrated start of each
width is cached on disk (`calibrated_start`), so a run killed at any moment loses at most the row in flight.
Every trained method runs the same distillation steps on the same batches (`make_trainer`;
the decoder's Linear layers train, the tied embedding stays). No method quantizes the embedding / tied LM head; the
eDKM paper's 8-bit clustering of it is measured on its own (`embedding_rows`). A seed other than 0 reruns the methods
that read the training text (calibration samples, training batches); the data-free ones give the same model at every
seed.

`calibration`: the wall time of our calibrated start of the whole model (table initialisation, refit and GPTQ
rounding onto the tables) against llmcompressor's GPTQ on the same model and calibration samples, in rounds whose
order alternates, a fresh model each time.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from harness import slices
from harness.common import Timings, machine_state, run_record

from areas.dkm import llamacpp, peers
from areas.dkm.smollm2 import TRAIN_BATCH, TRAIN_TOKENS, SmolLM2, cluster_embedding
from areas.dkm.workloads import make_trainer

BITS = (2, 3, 4)
START = {"scale_block_size": 64, "lut_dtype": "float16", "calibration_refit": True}  # recipe="calibrated"'s start
EMBEDDING_BITS = 8
EMBEDDING_WIDTH = 3  # the width whose trained model is also measured with its embedding clustered


def _names(bits: int) -> dict[str, str]:
    from hf_llmkit import DKMConfig

    edkm = DKMConfig(bits=bits, **START)  # what the eDKM row runs: recipe="dkm"'s soft forward and iterations
    return {
        "start": f"DKM {bits}-bit, scales per 64 inputs, refit + calibrated, no training (ours)",
        "trained": f"DKM {bits}-bit, trained from that start, recipe='calibrated' (ours)",
        "soft": (
            f"eDKM {bits}-bit, soft assignment (temperature {edkm.temperature:g}) with {edkm.dkm_iters} "
            "importance-weighted centroid iterations a forward, trained from that start (ours)"
        ),
    }


def embedding_name(trained: str) -> str:
    return f"{trained} + embedding / tied LM head {EMBEDDING_BITS}-bit k-means"


SOURCE_EMBEDDING = f"source decoder + embedding / tied LM head {EMBEDDING_BITS}-bit k-means (ours)"
REFERENCE = "fp32 (reference)"


def planned_rows(bits: int) -> list[str]:
    """The names of the rows a full run measures at `bits`: ours, then the peers (llama.cpp's apart)."""
    return [*_names(bits).values(), *peer_plan(bits, quick=False)]


def peer_plan(bits: int, quick: bool) -> dict[str, tuple]:
    """{name: (function, trained, data_free, extra kwargs)} of the peers at `bits`, the data-free ones first."""
    plan = {f"torchao int{bits} g64 asymmetric, weight-only PTQ": (peers.torchao_ptq, False, True, {}),
            f"HQQ {bits}-bit g64": (peers.hqq, False, True, {}),
            f"coremltools k-means {bits}-bit": (peers.coreml_kmeans, False, True, {})}  # fmt: skip
    if bits == 4:
        plan["bitsandbytes nf4"] = (peers.bnb_nf4, False, True, {})
    if not quick:
        for group in (64, 128):
            gptq = {"calibration": None, "group_size": group}
            plan[f"GPTQ {bits}-bit g{group} (llmcompressor)"] = (peers.gptq, False, False, gptq)
    plan[f"torchao QAT int{bits} g64"] = (peers.torchao_qat, True, False, {})
    return plan


def _measure(workload, name: str, bits: int, trained: bool, steps: int, fn) -> tuple[dict, object]:
    """One row: `fn()` returns (model, bits per weight, optionally the row's own fields); then the model's metrics.
    (row, model or None). `$HF_LLMKIT_BENCH_CRASH` naming the row kills the process as it starts it (tests)."""
    slices.crash_if_named(name)
    row = {"method": name, "bits": bits, "trained": trained, "steps": steps if trained else 0}
    model = None
    start, cpu = time.perf_counter(), time.process_time()
    try:  # timed without PeakMemory: its per-operator hook would dominate GPTQ-style column loops
        model, row["bpw"], *fields = fn()
        row["seconds"], row["cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
        row.update(*fields)
        row.update(workload.evaluate(model))
    except Exception as exc:  # noqa: BLE001 - a method that cannot run here is reported with its reason
        row["error"] = slices.one_line(exc)
        traceback.print_exc(limit=3, file=sys.stderr)
    shown = {k: round(v, 4) for k, v in row.items() if isinstance(v, float)}
    print(f"  {workload.name}: {name}: {shown} {row.get('error', '')}", file=sys.stderr, flush=True)
    return row, model


class Table:
    """The rows a run of the section adds: which it measures (`wanted`: chosen by `--rows` / `--data-free`, and not
    recorded in the results file under the same settings: a rerun measures only the missing rows), and what it
    measured (`rows`, `extra`), saved by `keep(section)` after every row."""

    def __init__(self, stored: dict | None, args, save):
        held = [*(stored or {}).get("rows", []), *(stored or {}).get("embedding_rows", [])]
        self.recorded = set() if args.remeasure else {r["method"] for r in held}
        self.chosen, self.data_free_only = [c.lower() for c in args.rows or []], args.data_free
        self.rows, self.extra, self.save = [], [], save
        self.stored_rows = (stored or {}).get("rows", [])
        self.tokenizer = (stored or {}).get("llama_cpp_tokenizer")  # llama.cpp's tokenizer check, made once

    def wanted(self, name: str, data_free: bool) -> bool:
        if self.chosen and not any(c in name.lower() for c in self.chosen):
            return False
        if self.data_free_only and not data_free:
            return False
        if name in self.recorded:
            print(f"  recorded already (kept): {name}", file=sys.stderr, flush=True)
            return False
        return True

    def add(self, row: dict, *, extra: bool = False) -> None:
        (self.extra if extra else self.rows).append(row)
        self.recorded.add(row["method"])
        self.save()


def start_path(workload, bits: int, calibration: dict) -> Path:
    """Where the calibrated start of `bits` is cached: a file named by a digest of everything that determines it
    (the model, its layers, the width, the start's settings, the skipped modules, the calibration inputs, torch and
    hf_llmkit's quantization code)."""
    import hashlib
    import importlib.metadata

    import hf_llmkit.quantization as quantization
    from hf_llmkit.data.corpus import default_cache_dir
    from hf_llmkit.testing import SMOLLM2_PACKAGE

    digest = hashlib.sha256()
    key = {"model": workload.name, "package": importlib.metadata.version(SMOLLM2_PACKAGE),
           "layers": workload.teacher.config.num_hidden_layers, "bits": bits, "start": START,
           "skip": list(workload.skip), "torch": torch.__version__}  # fmt: skip
    digest.update(json.dumps(key, sort_keys=True).encode())
    for name in sorted(calibration):
        digest.update(name.encode() + calibration[name].contiguous().numpy().tobytes())
    for source in sorted(Path(quantization.__file__).parent.rglob("*.py")):
        digest.update(source.read_bytes())
    return default_cache_dir() / "dkm_quality" / f"start-{bits}bit-{digest.hexdigest()[:20]}.pt"


def calibrated_start(workload, bits: int, calibration: dict, measured: bool):
    """(model or None, {state, bpw, seconds, cpu_s}): the calibrated start of `bits` from its cache file, or computed
    and cached (written atomically: a temporary file renamed over the name) with the model (`measured`: to evaluate
    as the start row)."""
    path = start_path(workload, bits, calibration)
    if path.is_file():
        print(f"  calibrated start {bits}-bit: from its cache {path.name}", file=sys.stderr, flush=True)
        return None, torch.load(path, weights_only=True)
    print(f"  calibrated start {bits}-bit: computing (cached as {path.name})", file=sys.stderr, flush=True)
    model = workload.load()
    start, cpu = time.perf_counter(), time.process_time()
    bpw = peers.dkm(model, bits, workload.skip, None, calibration=calibration, **START)
    cached = {"state": peers.dkm_state(model), "bpw": bpw, "seconds": time.perf_counter() - start,
              "cpu_s": time.process_time() - cpu}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(cached, temporary)
    os.replace(temporary, path)
    return (model if measured else None), cached


def width_rows(workload, bits: int, args, train, calibration, table: Table) -> None:
    """The table's rows at `bits` that `table` wants, the cheap ones first: llama.cpp's formats, the data-free peers,
    then ours (the calibrated start, cached on disk, and the rows trained from it, with the embedding row measured on
    our trained model) and the peers that read the training text."""
    skip, names = workload.skip, _names(bits)
    plan = peer_plan(bits, args.quick)
    if args.seed:  # the data-free peers give the same model at every seed
        plan = {name: entry for name, entry in plan.items() if not entry[2]}
    for name, (fn, trained, data_free, kwargs) in plan.items():
        if data_free and table.wanted(name, True):
            row = _peer_row(workload, name, bits, args, train, calibration, fn, trained, kwargs)
            table.add({**row, "data_free": True})
    if not args.quick and not args.seed:
        for name, fmt, width in llamacpp.plan([bits]):
            if table.wanted(name, True):
                table.add({**_llamacpp_row(workload, name, fmt, width, table), "data_free": True})
    with_embedding = bits == EMBEDDING_WIDTH and not args.quick
    want = {key: table.wanted(names[key], False) for key in ("start", "trained", "soft")}
    if with_embedding and not want["trained"]:
        want["trained"] = table.wanted(embedding_name(names["trained"]), False)
    if any(want.values()):
        model, cached = None, None

        def start():
            nonlocal model, cached
            model, cached = calibrated_start(workload, bits, calibration, measured=True)
            if model is None:  # cached by a run killed before its row was saved: the row from the cache
                model = workload.load()
                peers.dkm(model, bits, skip, None, start=cached["state"], **START)
            return model, cached["bpw"], {"seconds": cached["seconds"], "cpu_s": cached["cpu_s"]}

        if want["start"]:
            row, model = _measure(workload, names["start"], bits, False, args.steps, start)
            table.add(row)
            del model
        else:
            cached = calibrated_start(workload, bits, calibration, measured=False)[1]

        def from_start(options):
            def run():
                model = workload.load()
                return model, peers.dkm(model, bits, skip, train, start=cached["state"], **options)

            return run

        if cached is not None and want["trained"]:
            trained = from_start({"recipe": "calibrated"})
            row, model = _measure(workload, names["trained"], bits, True, args.steps, trained)
            if model is not None and "error" not in row and with_embedding:
                emb = cluster_embedding(model, EMBEDDING_BITS)
                table.extra.append({"method": embedding_name(names["trained"]), "bits": bits, "bpw": row["bpw"],
                                    "embedding_bpw": emb, **workload.evaluate(model)})  # fmt: skip
            table.add(row)  # with its embedding row: a run killed between them measures both again
            del model
        if cached is not None and want["soft"]:
            table.add(_measure(workload, names["soft"], bits, True, args.steps, from_start(START))[0])
    for name, (fn, trained, data_free, kwargs) in plan.items():
        if not data_free and table.wanted(name, False):
            row = _peer_row(workload, name, bits, args, train, calibration, fn, trained, kwargs)
            table.add({**row, "data_free": False})


def _peer_row(workload, name, bits, args, train, calibration, fn, trained, kwargs) -> dict:
    def run():
        model = workload.load()
        options = {**kwargs, "calibration": calibration} if "calibration" in kwargs else kwargs
        return model, fn(model, bits, workload.skip, train if trained else None, **options)

    return _measure(workload, name, bits, trained, args.steps, run)[0]


def _llamacpp_row(workload, name: str, fmt: str | None, width: int, table: Table) -> dict:
    slices.crash_if_named(name)
    if table.tokenizer is None and llamacpp.available() is None:
        table.tokenizer = llamacpp.tokenizer_check(workload.eval_text, workload.eval_ids)
    earlier = {r["digest"]: r for r in [*table.stored_rows, *table.rows] if "digest" in r and "error" not in r}
    row = {"method": name}
    try:
        with tempfile.TemporaryDirectory(prefix="dkm_llamacpp_") as work:
            row.update(llamacpp.measure(workload, fmt, width, torch.get_num_threads(), Path(work), earlier))
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported with its reason
        row.update(bits=width, trained=False, steps=0, error=slices.one_line(exc))
        traceback.print_exc(limit=3, file=sys.stderr)
    shown = {k: round(v, 4) for k, v in row.items() if isinstance(v, float)}
    print(f"  {workload.name}: {name}: {shown} {row.get('error', '')}", file=sys.stderr, flush=True)
    return row


SETTINGS = ("steps", "lr", "split", "block", "calibration", "train_batch")  # rows of one table share these


def check_settings(stored: dict | None, section: dict, args) -> None:
    """Refuse in one line, before any measuring, a run whose settings differ from the rows the file holds for this
    section (one table, one set of settings), unless `--new-table` starts it anew."""
    if not stored or not stored.get("rows") or args.new_table:
        return
    differ = {k: (stored.get(k), section[k]) for k in SETTINGS if stored.get(k) != section[k]}
    if differ:
        said = ", ".join(f"{k} {old} (this run: {new})" for k, (old, new) in differ.items())
        hint = " ".join(f"--{k} {stored[k]:g}" for k in ("steps", "lr") if k in differ)
        raise SystemExit(
            f"error: benchmarks/results/dkm_quality.json's smollm2 rows were measured with {said}: "
            + (f"pass {hint} to add rows to that table, or " if hint else "")
            + "pass --new-table to measure a new one in its place"
        )


def run(args, keep=lambda section: None, stored: dict | None = None) -> dict:
    """The `smollm2` section: every width of `args.bits` (the rows `stored`, the section as the results file holds
    it, does not hold yet, unless `--remeasure`), the llama.cpp rows, the embedding rows; `keep(section)` after each
    row."""
    workload = make_workload(args)
    check_settings(stored, _section(workload, args, [], [], None), args)
    if args.new_table:
        stored = None
    table = Table(stored, args, lambda: keep(_section(workload, args, table.rows, table.extra, table.tokenizer)))
    train = make_trainer(workload, args.steps, args.lr, args.seed)
    calibration = workload.calibration()
    widths = args.bits or ((2,) if args.quick else BITS)
    if not args.seed:
        if table.wanted(REFERENCE, True):
            table.add({"method": REFERENCE, "bits": 32, "bpw": 32.0, **workload.reference_metrics()})
        if not args.quick and EMBEDDING_WIDTH in widths and table.wanted(SOURCE_EMBEDDING, True):
            model = workload.load()
            emb = cluster_embedding(model, EMBEDDING_BITS)
            table.add({"method": SOURCE_EMBEDDING, "bits": 32, "bpw": 32.0, "embedding_bpw": emb,
                       **workload.evaluate(model)}, extra=True)  # fmt: skip
            del model
    for bits in widths:
        width_rows(workload, bits, args, train, calibration, table)
    return _section(workload, args, table.rows, table.extra, table.tokenizer)


def _section(workload, args, rows: list, extra: list, tokenizer: dict | None) -> dict:
    teacher = workload.teacher
    return {
        "model": workload.name,
        "parameters": sum(p.numel() for p in teacher.parameters()),
        "layers": teacher.config.num_hidden_layers,
        "quantized_parameters": sum(m.weight.numel() for m in peers.linears(teacher, workload.skip).values()),
        "embedding_parameters": teacher.get_input_embeddings().weight.numel(),
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
        "new_table": bool(getattr(args, "new_table", False)),
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
    """A section measured again over part of the widths (`--bits`) or rows: the new rows replace the earlier rows of
    the same methods, the others stay; `runs` lists every run that wrote rows (its command and date). A run with
    `--new-table` (`new["new_table"]`) replaces the section."""
    new = dict(new)
    if new.pop("new_table", False):
        earlier = None
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
    wrote = new["rows"] or new["embedding_rows"]  # a rerun that found every row recorded measured nothing
    out["runs"] = [*(r for r in earlier.get("runs", []) if not same(r)), *([run] if wrote else [])]
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
