"""The fragments `benchmarks/report.py` writes into the docs: name -> (results files, render function).

A render function gets {results file name: its JSON} and returns markdown; `measured(...)` is the closing line of
every fragment (the date, command, machine and load that the results file recorded, and "LOADED MACHINE" when the
load exceeded the core count during the run). Register a new fragment with `@fragment("name", "results_file")`
(`harness/registry.py`); importing this module registers every fragment, those of `real_report.py` and
`soft_report.py` included.
"""

from __future__ import annotations

import statistics

from harness.common import markdown_table
from harness.registry import FRAGMENTS, fragment, measured

from areas.dkm import (
    real_report,  # noqa: F401 - registers the real-model fragments
    soft_report,  # noqa: F401 - registers dkm_steps and dkm_soft (issue 43's soft-assignment study)
)


def pair(values: list[float], digits: int = 2) -> str:
    """'min / median' of a list."""
    return f"{min(values):.{digits}f} / {statistics.median(values):.{digits}f}"


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{round(seconds % 60):02d}"


# -- CI and the quickstart ---------------------------------------------------------------------------------------


@fragment("ci", "ci")
def ci(results: dict) -> str:
    run = results["ci"]
    pytest = run["pytest"] or {"counts": {}, "seconds": 0.0}
    counts = ", ".join(f"{n} {kind}" for kind, n in pytest["counts"].items())
    status = "passed" if run["passed"] else f"FAILED (exit code {run['returncode']})"
    stages = "".join(f", `{name}` {minutes(seconds)}" for name, seconds in run.get("stages_s", {}).items())
    torch = " / ".join(v["torch"] for v in run.get("versions", []) if "torch" in v)
    return (
        f"CI from a fresh clone (`bash .ci/run` at {run['commit'][:7]}: a new virtual environment, empty caches) "
        f"{status} in {run['total_s'] / 60:.1f} minutes{stages}: install {run['install_s']} s, "
        f"ruff {run['ruff_s']} s, pytest {minutes(pytest['seconds'])} ({counts})"
        + (f"; torch {torch}" if torch else "")
        + ".\n\n"
        + measured(run, loads_itself=True)
    )


@fragment("quickstart", "quickstart")
def quickstart(results: dict) -> str:
    data = results["quickstart"]
    rows = [["variant", "process wall s (min / median)", "train s (min / median)", "train time x plain Trainer"]]
    for name, got in data["summary"].items():
        rows.append([name, pair(got["wall_s"], 1), pair(got["train_s"], 1), pair(got["train_ratio_to_peer"], 3)])
    rounds = len(next(iter(data["summary"].values()))["wall_s"])
    head = f"{data['steps']} steps, {rounds} round(s), each variant a fresh process, order rotated each round.\n\n"
    return head + markdown_table(rows) + "\n\n" + measured(data, f"{data['before']['torch_threads']} torch threads")


@fragment("quickstart_time", "quickstart")
def quickstart_time(results: dict) -> str:
    data = results["quickstart"]
    ours = data["summary"]["run_clm (make quickstart)"]
    return (
        f"`make quickstart` (environment installed) runs for {statistics.median(ours['wall_s']):.0f} s, "
        f"{statistics.median(ours['train_s']):.0f} s of it training {data['steps']} steps, "
        f"{pair(ours['train_ratio_to_peer'])} (min / median) times the training time of the same run on the plain "
        f"transformers `Trainer`.\n\n" + measured(data)
    )


@fragment("lm_data_memory", "lm_data_memory")
def lm_data_memory(results: dict) -> str:
    data = results["lm_data_memory"]
    runs = [
        f"{r['size_mb']:g} MB in {r['seconds']:.0f} s at a peak resident memory of {r['peak_rss_mb']:.0f} MB, "
        f"{r['added_mb']:.0f} MB over the imports and the tokenizer"
        for r in data["runs"]
    ]
    return (
        f"A text of one line, tokenized into blocks of {data['block_size']} tokens with a cache folder (a fresh "
        f"process per size): {'; '.join(runs)}.\n\n" + measured(data)
    )


# -- sequence parallelism ---------------------------------------------------------------------------------------


SP_PEERS = {"hf_llmkit plain": "deepspeed ulysses", "hf_llmkit alst": "deepspeed alst"}


def _sp_threads(data: dict) -> str:
    return f"{data['config']['threads']} torch thread(s) per rank"


@fragment("sp_memory", "sequence_parallel")
def sp_memory(results: dict) -> str:
    data = results["sequence_parallel"]
    runs, config = data["runs"], data["config"]
    base = runs.get("1", {}).get("memory", {}).get("hf_llmkit plain", {}).get("max_seq")
    names = list(dict.fromkeys(name for run in runs.values() for name in run["memory"]))
    rows = [["variant", *[f"sp={sp}" for sp in runs], f"sp={max(runs, key=int)} x plain sp=1"]]
    for name in names:
        got = [runs[sp]["memory"].get(name, {}) for sp in runs]
        cells = [(">=" * bool(g.get("capped")) + str(g["max_seq"])) if g.get("max_seq") else "-" for g in got]
        last = got[-1].get("max_seq")
        rows.append([name, *cells, f"{last / base:.1f}x" if last and base else "-"])
    head = (
        f"Longest trainable sequence (tokens) within {config['budget_mib']:g} MiB of peak tensor memory per rank "
        f"({config['device']}; tiles of {config['chunk']} positions):\n\n"
    )
    spreads = {sp: max(run["losses"].values()) - min(run["losses"].values()) for sp, run in runs.items()}
    agree = ", ".join(f"{spreads[sp]:.0e} (sp={sp}, {config['probe'] * int(sp)} tokens)" for sp in runs)
    agree = "exactly" if not any(spreads.values()) else f"within {agree}"
    tail = f"\n\nThe losses of all variants at the first probe length agree {agree}."
    grads = runs.get("1", {}).get("head_grad_vs_plain")
    if grads:  # measured at sp = 1
        ours = [r for name, r in grads.items() if name.startswith("hf_llmkit")]
        peers = "; ".join(f"{name} {r:.3g}" for name, r in grads.items() if not name.startswith("hf_llmkit"))
        tail += (
            f" At sp=1 the LM head's weight-gradient norm against the plain model's (token-mean loss, "
            f"{config['probe']} tokens): every hf_llmkit variant {min(ours):.3f}-{max(ours):.3f}; {peers}."
        )
    return head + markdown_table(rows) + tail + "\n\n" + measured(data, _sp_threads(data))


@fragment("sp_time", "sequence_parallel")
def sp_time(results: dict) -> str:
    data = results["sequence_parallel"]
    rows = [["sp", "variant", "median s", "x plain (min / median)", "x DeepSpeed, same switches (min / median)"]]
    medians: dict[str, list[float]] = {}  # variant -> median ratio to plain at each sp
    for sp, run in data["runs"].items():
        seconds = run["seconds"]
        for name, times in seconds.items():
            peer = SP_PEERS.get(name)
            vs_peer = [a / b for a, b in zip(times, seconds[peer])] if peer in seconds else None
            vs_plain = [a / b for a, b in zip(times, seconds["hf_llmkit plain"])]
            medians.setdefault(name, []).append(statistics.median(vs_plain))
            if vs_peer:
                medians.setdefault(f"{name} / {peer}", []).append(statistics.median(vs_peer))
            peer_cell = pair(vs_peer) if vs_peer else ""
            rows.append([sp, name, f"{statistics.median(times):.3f}", pair(vs_plain), peer_cell])
    span = lambda key: f"{min(medians[key]):.2f}-{max(medians[key]):.2f}" if key in medians else "-"  # noqa: E731
    summary = (
        f"Medians over sp = {', '.join(data['runs'])}: ALST costs {span('hf_llmkit alst')}x the plain step, "
        f"checkpointing alone {span('hf_llmkit ckpt')}x, tiling alone {span('hf_llmkit tiled')}x; ours / DeepSpeed "
        f"with the same switches: plain / Ulysses {span('hf_llmkit plain / deepspeed ulysses')}, ALST "
        f"{span('hf_llmkit alst / deepspeed alst')}."
    )
    head = f"One forward + backward at {data['config']['time_seq']} tokens, slowest rank per round:\n\n"
    return head + markdown_table(rows) + "\n\n" + summary + "\n\n" + measured(data, _sp_threads(data))


@fragment("sp_offload", "sequence_parallel_offload")
def sp_offload(results: dict) -> str:
    from areas.parallel.offload_bytes import offload_rows

    data = results["sequence_parallel_offload"]
    rows = offload_rows(data["designs"])
    head = (
        f"Bytes each activation-offload design copies to host memory in one step ({data['seq']} tokens, "
        f"{data['layers']} checkpointed layers, {data['device']}; on an accelerator they go to the host in the "
        "forward and come back in the backward):\n\n"
    )
    tail = ""
    if data["device"] == "cpu":
        tail = (
            "\n\nOn this CPU-only run DeepSpeed's offload copies nothing: its engine skips tensors that are not on "
            "an accelerator (its design keeps the last checkpoint input on the device and moves the others)."
        )
    return head + markdown_table(rows) + tail + "\n\n" + measured(data)


# -- MoE ----------------------------------------------------------------------------------------------------------

FLOOR, OURS, TRAFFIC = "dense MLP x2 (floor)", "hf_llmkit MoELayer dropless", "E experts' weight traffic only"
TORCH_OPS = f"{OURS}, torch ops"


@fragment("moe_layers", "moe")
def moe_layers(results: dict) -> str:
    data = results["moe"]
    rows = [["experts", "tokens", "threads", "ours / floor", "weight traffic / floor", "ours / E even",
             "ours / best dropless peer", "best dropless peer", "ours / DeepSpeed capacity 1.0"]]  # fmt: skip
    for r in data["layers"]:
        summary = r["timings"]["summary"]
        dropless = {p: v for p, v in r["ours_vs_peers"].items() if "capacity" not in p}
        best = max(dropless, key=lambda p: dropless[p]["median"])  # the closest competitor
        capacity = r["ours_vs_peers"].get("DeepSpeed MoE capacity 1.0")
        ratio = lambda d: f"{d['min']:.2f} / {d['median']:.2f}"  # noqa: E731
        best_name = best + " (one call)" * bool(dropless[best].get("single_call"))
        rows.append(
            [str(r["experts"]), f"{r['tokens']:,}", str(r["threads"]),
             f"{summary[OURS]['ratio_min']:.2f} / {summary[OURS]['ratio_median']:.2f}",
             f"{summary[TRAFFIC]['ratio_min']:.2f} / {summary[TRAFFIC]['ratio_median']:.2f}",
             ratio(r["ours_vs_even"]), ratio(dropless[best]), best_name, ratio(capacity) if capacity else "-"]
        )  # fmt: skip
    config = data["config"]
    head = (
        f"One forward + backward, H {config.get('hidden', 256):,}, I {config.get('inter', 1024):,}, top-2, "
        f"{config.get('dtype', 'fp32')}; ratios are min / median of per-round ratios.\n\n"
    )
    return head + markdown_table(rows) + "\n\n" + measured(data, "torch threads as in the table")


@fragment("moe_summary", "moe")
def moe_summary(results: dict) -> str:
    """What the layer table says, as sentences computed from it (medians of per-round ratios)."""
    layers = results["moe"]["layers"]
    ours = {id(r): r["timings"]["summary"][OURS]["ratio_median"] for r in layers}
    span = lambda values: f"{min(values):.2f}-{max(values):.2f}"  # noqa: E731
    few = [ours[id(r)] for r in layers if r["experts"] <= 16 and r["tokens"] >= 2048]
    wins = [r for r in layers if all(v["median"] < 1 for p, v in r["ours_vs_peers"].items() if "capacity" not in p)]
    even = [r["ours_vs_even"]["median"] for r in layers]
    traffic = [r["timings"]["summary"][TRAFFIC]["ratio_median"] for r in layers if r["experts"] == max_experts(layers)]
    diffs = [d for r in layers for d in r["diffs"].values()]
    lines = [
        f"- ours / floor: {span(list(ours.values()))} over the {len(layers)} configurations, {span(few)} with at most "
        "16 experts and 2,048 tokens or more;"
        if few
        else f"- ours / floor: {span(list(ours.values()))};",
        f"- faster than every dropless peer at the median in {len(wins)} of {len(layers)} configurations;",
        f"- ours / E dense MLPs on even rows: {span(even)} (above 1: what routing, sorting and scatter-back cost);",
        f"- the weight traffic alone at {max_experts(layers)} experts: {span(traffic)} of the floor;",
        *undone_lines(layers, span),
        *registry_lines(layers, span),
        f"- outputs and input gradients against Mixtral eager on the same input: max |diff| "
        f"{max(max(d['output'], d['grad_input']) for d in diffs):.1e}."
        if diffs
        else "",
    ]
    return "\n".join(line for line in lines if line) + "\n\n" + measured(results["moe"])


def registry_lines(layers: list[dict], span) -> list[str]:
    """Our expert compute inside transformers' own Mixtral block (`experts_implementation="llmkit"`) against the
    block's default, grouped_mm, and against `MoELayer` (results without it: nothing)."""
    runs = [r["registry"] for r in layers if r.get("registry")]
    if not runs:
        return []
    grouped = [r["grouped_mm"]["median"] for r in runs]
    layer = [r["moe_layer"]["median"] for r in runs]
    return [
        f'- ours inside transformers\' Mixtral block (`experts_implementation="llmkit"`) / grouped_mm in the same '
        f"block: {span(grouped)}; / `MoELayer`: {span(layer)};"
    ]


def undone_lines(layers: list[dict], span) -> list[str]:
    """What the C kernels are worth: ours against ours on torch's ops (medians; below 1: they help)."""
    kernel = [r["ours_vs_undone"][TORCH_OPS]["median"] for r in layers if TORCH_OPS in r.get("ours_vs_undone", {})]
    if not kernel:
        return []
    return [f"- ours / ours on torch's ops (what the C SwiGLU and routing kernels are worth): {span(kernel)};"]


def max_experts(layers: list[dict]) -> int:
    return max(r["experts"] for r in layers)


@fragment("moe_upcycling", "moe")
def moe_upcycling(results: dict) -> str:
    data = results["moe"]
    if not data["upcycled_training"]:
        return "(the upcycling part did not run: `--train-steps 0`)\n\n" + measured(data)
    rows = [["moe_aux_loss_coef", "final LM loss", "max/min expert load (last window)", "per window"]]
    for t in data["upcycled_training"]:
        windows = ", ".join(f"{v:.2f}" for v in t["ratio_per_window"])
        loss, balance = f"{t['final_lm_loss']:.3f}", f"{t['load_max_min_ratio']:.2f}"
        rows.append([str(t["moe_aux_loss_coef"]), loss, balance, windows])
    steps = data["config"]["train_steps"]
    head = f"Upcycled tiny Llama (8 experts, top-2), {steps} `LLMKitTrainer` steps on the embedded corpus:\n\n"
    return head + markdown_table(rows) + "\n\n" + measured(data)


# -- PEFT ---------------------------------------------------------------------------------------------------------


def _peft_threads(data: dict) -> str:
    device = data["device"]  # "cpu x<n> threads" or "cuda"
    return f"{device.split('x')[1].split()[0]} torch thread(s)" if device.startswith("cpu x") else device


PEFT_OURS = ("bottleneck houlsby", "bottleneck pfeiffer", "bottleneck parallel", "bitfit", "ptuning v1", "ptuning v2")
TARGETS = ("vs_lora", "vs_adapters", "vs_adapters_full_ft_ratio")


def _bold(method: str) -> str:
    return f"**{method}**" if method in PEFT_OURS else method


def _peft_workload(data: dict, kind: str) -> str:
    w = data["workloads"][kind]
    methods = w["methods"]
    full, lora = methods["full fine-tuning"]["step_ms"], methods.get("peft LoRA r=8 (attention)", {}).get("step_ms")
    rows = [["method", "trainable", "trainable %", "step ms", "x full FT", "x LoRA", "memory MiB"]]
    for name, m in methods.items():
        step, vs_lora = m["step_ms"], f"{m['step_ms'] / lora:.2f}" if lora else "-"
        share, memory = f"{100 * m['trainable'] / m['total']:.3f}", f"{m['memory_mib']:.1f}"
        rows.append([_bold(name), f"{m['trainable']:,}", share, f"{step:.1f}", f"{step / full:.2f}", vs_lora, memory])
    peers = w.get("adapterhub", {})
    peer_full = peers.get("full fine-tuning", {}).get("step_ms")
    versions = data["adapterhub"].get("versions", {})
    for name, peer in peers.items():
        if name.startswith("adapters ") and peer_full:
            label = f"{name} (AdapterHub {versions.get('adapters', '?')}, own process)"
            step, vs_full = f"{peer['step_ms']:.1f}", f"{peer['step_ms'] / peer_full:.2f}"
            rows.append([label, f"{peer['trainable']:,}", "-", step, vs_full, "-", "-"])
    for name, why in w["skipped"].items():
        rows.append([name, f"n/a: {why}", "", "", "", "", ""])
    shapes = data["shapes"]
    head = f"{w['title']}: batch {shapes['batch']} x {shapes['seq']} tokens, fastest of interleaved steps.\n\n"
    return head + markdown_table(rows) + "\n\n" + measured(data, _peft_threads(data))


@fragment("peft_llama", "peft_methods")
def peft_llama(results: dict) -> str:
    return _peft_workload(results["peft_methods"], "llama")


@fragment("peft_minilm", "peft_methods")
def peft_minilm(results: dict) -> str:
    return _peft_workload(results["peft_methods"], "bert")


@fragment("peft_vs_full", "peft_methods")
def peft_vs_full(results: dict) -> str:
    """Step time / full fine-tuning per method, both workloads side by side (AdapterHub: its own process's ratio)."""
    data = results["peft_methods"]
    kinds = list(data["workloads"])
    ratios: dict[str, dict[str, float]] = {}
    for kind, w in data["workloads"].items():
        full = w["methods"]["full fine-tuning"]["step_ms"]
        for name, m in w["methods"].items():
            ratios.setdefault(name, {})[kind] = m["step_ms"] / full
        peer_full = w.get("adapterhub", {}).get("full fine-tuning", {}).get("step_ms")
        for name, peer in w.get("adapterhub", {}).items():
            if name.startswith("adapters ") and peer_full:
                label = f"AdapterHub {name.removeprefix('adapters ')} (own process)"
                ratios.setdefault(label, {})[kind] = peer["step_ms"] / peer_full
    rows = [["method", *[f"{data['workloads'][k]['title'].split(' (')[0]}: step / full FT" for k in kinds]]]
    for name, by_kind in ratios.items():
        if name != "full fine-tuning":
            rows.append([_bold(name), *[f"{by_kind[k]:.2f}" if k in by_kind else "-" for k in kinds]])
    return markdown_table(rows) + "\n\n" + measured(data, _peft_threads(data))


@fragment("peft_targets", "peft_methods")
def peft_targets(results: dict) -> str:
    data = results["peft_methods"]
    rows = [["workload", "bottleneck", "step x LoRA", "calibrated step x AdapterHub", "step/full FT x AdapterHub's"]]
    for w in data["workloads"].values():
        for placement, t in w["targets"].items():
            cells = [f"{t[key]:.2f}" if t.get(key) is not None else "-" for key in TARGETS]
            rows.append([w["title"].split(" (")[0], placement, *cells])
    note = data["adapterhub"].get("error")
    tail = f"\n\nAdapterHub could not run: {note}" if note else ""
    return markdown_table(rows) + tail + "\n\n" + measured(data, _peft_threads(data))


@fragment("peft_quality", "peft_methods")
def peft_quality(results: dict) -> str:
    data = results["peft_methods"]
    rows = [["method", "held-out perplexity"]]
    for name, value in data["quality"].items():
        rows.append([_bold(name), f"{value:.2f}" if isinstance(value, float) else value])
    steps = data.get("quality_steps")
    head = (
        f"all-MiniLM-L6-v2 masked LM after {f'{steps} training steps' if steps else 'a short training'} on the "
        "embedded corpus, each method from the same fitted head (lower is better):\n\n"
    )
    return head + markdown_table(rows) + "\n\n" + measured(data, _peft_threads(data))


# -- callbacks ----------------------------------------------------------------------------------------------------


@fragment("callbacks_overhead", "callbacks")
def callbacks_overhead(results: dict) -> str:
    data = results["callbacks"]
    rows = [["callback", "fastest step ms", "callback us per step", "overhead %"]]
    for name, row in data["overhead"]["callbacks"].items():
        cost = f"{row['callback_us_per_step']:.1f}"
        rows.append([name, f"{row['step_ms']:.1f}", cost, f"{row['overhead_pct']:.3f}"])
    e2e = data["overhead"]["end_to_end"]
    tail = (
        f"\n\nEnd to end, interleaved runs (fastest step, median of rounds): no callbacks {e2e['none_ms']:.1f} ms, "
        f"all three {e2e['all_three_ms']:.1f} ms, ratio {e2e['ratio']:.3f}."
    )
    threads = f"{data['machine'][0]['torch_threads']} torch threads"
    return markdown_table(rows) + tail + "\n\n" + measured(data, threads)


@fragment("callbacks_checkpoint", "callbacks")
def callbacks_checkpoint(results: dict) -> str:
    data = results["callbacks"]
    ckpt = data["checkpoint"]
    rows = [["save", "median s", "x plain Trainer save"]]
    for name, row in ckpt["rows"].items():
        rows.append([name, f"{row['seconds']:.3f}", f"{row['ratio_vs_peer']:.2f}"])
    head = f"A {ckpt['checkpoint_mb']:.1f} MiB checkpoint (model, optimizer, scheduler, RNG), median of saves:\n\n"
    return head + markdown_table(rows) + "\n\n" + measured(data)


# -- DKM ----------------------------------------------------------------------------------------------------------


@fragment("dkm_speed", "dkm")
def dkm_speed(results: dict) -> str:
    """Section (a) + (b) of benchmarks/dkm.py: one training step of one Linear against coremltools' DKMPalettizer."""
    data = results["dkm"]
    rows = [["layer", "bits", "coremltools s/step", "ours fp32: speed-up", "fp32 saved MiB: peer / ours",
             "ours bf16: speed-up", "init s: ours fp32 / coremltools"]]  # fmt: skip
    for r in data["speed"]:
        sliced = f" ({r['peer_rows']}-row slice)" if r["scale"] != 1 else ""
        peer = f"{statistics.median(r['peer_seconds']):.3g}{sliced}"
        speed = lambda o: f"{o['speedup_min']:.1f}x / {o['speedup_median']:.1f}x"  # noqa: E731
        fp32 = r["fp32"]
        saved = f"{r['peer_saved'] / 2**20:,.0f} / {fp32['saved'] / 2**20:,.2f} ({fp32['memory_ratio']:,.0f}x)"
        init = f"{r['fp32']['init']:.2f} / {r['peer_init']:.1f}"
        rows.append([r["layer"], str(r["bits"]), peer, speed(r["fp32"]), saved, speed(r["bf16"]), init])
    head = (
        "One training step (forward and backward of the clustering, 16 tokens, 3 iterations) against coremltools' "
        "`DKMPalettizer`; speed-ups are min / median of per-round ratios; a peer that ran on a slice of rows is "
        "scaled to the whole layer (its tensors are all row-shaped); its init is on the rows it ran.\n\n"
    )
    return head + markdown_table(rows) + "\n\n" + measured(data, "1 torch thread")


def _dkm_verdict(name: str, metrics: list[str], rows: list[dict]) -> list[str]:
    """Per index width: our best DKM row (trained, or refit and calibrated without training; not plain k-means) against
    the best peer storing no more bits per weight, and against the best peer of the same index width (whatever its
    scales cost), metric by metric."""
    lines = []
    for bits in (2, 3, 4):
        same = [r for r in rows if r.get("bits") == bits and "error" not in r]
        ours = [r for r in same if "(ours)" in r["method"] and (r.get("trained") or "calibrated" in r["method"])]
        if not ours:
            continue
        parts = []
        for m in metrics:
            lower = m in ("ppl", "worst_block_ratio")
            pick = min if lower else max
            best = pick(ours, key=lambda r: r[m])
            cheap = [r for r in rows if "(ours)" not in r["method"] and "error" not in r and r.get("bits") != 32
                     and r["bpw"] <= best["bpw"] + 0.01]  # fmt: skip
            wide = [r for r in same if "(ours)" not in r["method"]]
            said = []
            for label, group in (("at no more bits", cheap), (f"any {bits}-bit peer", wide)):
                if group:
                    peer = pick(group, key=lambda r: r[m])
                    ahead = best[m] < peer[m] if lower else best[m] > peer[m]
                    said.append(f"{label} {peer[m]:.4g} ({peer['method']}, {peer['bpw']:.2f}) "
                                f"{'behind us' if ahead else 'ahead of us'}")  # fmt: skip
            parts.append(f"{m} {best[m]:.4g}: " + ", ".join(said))
        lines.append(f"- {name}, DKM {bits}-bit: " + "; ".join(parts))
        lines += _training_verdict(name, bits, metrics, same)
    return lines


def _training_verdict(name: str, bits: int, metrics: list[str], rows: list[dict]) -> list[str]:
    """Whether training from the best post-training state (recipe='calibrated') improves on that start, per metric."""
    start = next((r for r in rows if "refit + calibrated, no training (ours)" in r["method"]), None)
    trained = next((r for r in rows if "recipe='calibrated'" in r["method"]), None)
    if start is None or trained is None:
        return []
    parts, better = [], []
    for m in metrics:
        up = trained[m] < start[m] if m in ("ppl", "worst_block_ratio") else trained[m] > start[m]
        better.append(up)
        parts.append(f"{m} {start[m]:.4g} -> {trained[m]:.4g}")
    verdict = "improves on" if all(better) else "improves on part of" if any(better) else "does NOT improve on"
    return [f"- {name}, DKM {bits}-bit: training from the calibrated start {verdict} it: " + ", ".join(parts)]


def _seed_spread(data: dict) -> str:
    """The rows measured again with another seed (`--seed`): each beside its seed-0 value, and per width whether our
    trained row (recipe='calibrated') beats every peer by more than the two seeds' spread."""
    parts = []
    for name, runs in data.get("seeds", {}).items():
        main = {r["method"]: r for r in data["workloads"].get(name, {}).get("rows", []) if "error" not in r}
        for seed, run in runs.items():
            metrics = list(run["metrics"])
            same = [(main[r["method"]], r) for r in run["rows"] if r["method"] in main and "error" not in r
                    and r.get("bits") != 32]  # fmt: skip
            if not same:
                continue
            table = [["method", "bits/weight", *(f"{m}: seed 0 / seed {seed}" for m in metrics)]]
            for a, b in same:
                method = f"**{a['method']}**" if "(ours)" in a["method"] else a["method"]
                table.append([method, f"{a['bpw']:.2f}", *(f"{a[m]:.4f} / {b[m]:.4f}" for m in metrics)])
            lines = []
            for bits in sorted({a["bits"] for a, _ in same}):
                ours = next(((a, b) for a, b in same if a["bits"] == bits and "recipe='calibrated'" in a["method"]),
                            None)  # fmt: skip
                rivals = [(a, b) for a, b in same if a["bits"] == bits and "(ours)" not in a["method"]]
                if ours is None or not rivals:
                    continue
                said = []
                for m in metrics:
                    sign = -1 if m in ("ppl", "worst_block_ratio") else 1  # margins are positive when we are ahead
                    margin = min(sign * (ours[i][m] - max(rivals, key=lambda r: sign * r[i][m])[i][m]) for i in (0, 1))
                    spread = max(abs(a[m] - b[m]) for a, b in [ours, *rivals])
                    verdict = "larger than" if margin > spread else "NOT larger than"
                    said.append(f"{m} margin {margin:.4f} over the best peer at either seed, {verdict} the largest "
                                f"seed-to-seed spread {spread:.4f}")  # fmt: skip
                lines.append(f"- {name}, {bits}-bit, trained from the calibrated start: " + "; ".join(said))
            when = run.get("measured")
            when = f" (`{when['command']}`, {when['date']})" if when else ""
            parts.append(f"**{name}**, seed 0 (the table above) against seed {seed}{when}: another order of the "
                         "training data and other calibration samples:\n\n" + markdown_table(table)
                         + ("\n\n" + "\n".join(lines) if lines else ""))  # fmt: skip
    return "\n\n".join(parts)


@fragment("dkm_quality", "dkm_quality")
def dkm_quality(results: dict) -> str:
    """benchmarks/dkm_quality.py: quality per bit against real peers on two workloads, and the step-time ratio."""
    data = results["dkm_quality"]
    out, verdict = [], []
    for name, w in data["workloads"].items():
        metrics = list(w["metrics"])
        rows = [["method", "bits/weight", *metrics, "compute s", "peak MiB"]]
        for r in w["rows"]:
            method = f"**{r['method']}**" if "(ours)" in r["method"] else r["method"]
            if "error" in r:
                rows.append([method, "-", *(["-"] * len(metrics)), "-", f"did not run: {r['error'][:80]}"])
                continue
            values = [f"{r[m]:.2f}" if m == "ppl" else f"{r[m]:.4f}" for m in metrics]
            rows.append([method, f"{r['bpw']:.2f}", *values, f"{r.get('seconds', 0):.0f}",
                         f"{r['peak_mb']:.0f}" if "peak_mb" in r else "-"])  # fmt: skip
        where = f", recipe `{w['recipe']}`" if "recipe" in w else ""
        when = w.get("measured")
        when = f"\n\nThese rows: {when['date']}, `{when['command']}`." if when else ""
        out.append(f"**{name}**{where}:\n\n" + markdown_table(rows) + when)
        jobs = [r["command"] for r in w["rows"] if "command" in r and "error" not in r]
        if jobs:
            out.append("The `run_clm.py` rows ran the main job on the pretrained checkpoint and reloaded what it "
                       "saved:\n" + "\n".join(f"`{job}`" for job in jobs))  # fmt: skip
        verdict += _dkm_verdict(name, metrics, w["rows"])
    head = (
        f"Every trained method: the same {data['steps']} AdamW steps (learning rate {data['lr']:g}) of distillation "
        f"from the fp32 model on the same batches{', dropout off' if data.get('dropout') == 0 else ''}. "
        "Bits per weight over the quantized matrices, tables, scales and "
        "zero points included (peers' scales and zeros at 16 bits, our tables at the width they are saved in: 32 "
        "bits, 16 for the rows with 16-bit tables)."
    )
    if "calibration_samples" in data:
        head += (
            f" The calibrated methods (GPTQ, ours) see the first {data['calibration_samples']} training sentences "
            "(MiniLM) or blocks (the causal LM)."
        )
    head += "\n\n"
    text = head + "\n\n".join(out)
    if verdict:
        text += "\n\nOur best DKM row (trained, or refit and calibrated) against the best peer (bits per weight in "
        text += "brackets):\n\n"
        text += "\n".join(verdict)
    seeds = _seed_spread(data)
    if seeds:
        text += "\n\n" + seeds
    return text + "\n\n" + measured(data)


@fragment("dkm_job", "dkm_quality")
def dkm_job(results: dict) -> str:
    """benchmarks/dkm_quality.py --only job: where the main job's time goes at Llama shapes, DKM against full
    fine-tuning (benchmarks/areas/dkm/job.py)."""
    data = results["dkm_quality"].get("job_times")
    if not data:
        return "Not measured yet: `python benchmarks/dkm_quality.py --only job`."
    rows = [["shape (parameters)", "job", "wall s", "model build s (k-means s)", "2 steps s", "2 evaluations s",
             "final save s", "the rest s", "peak RSS GiB", "wall x full fine-tuning"]]  # fmt: skip
    plain = {r["shape"]: r for r in data["rows"] if "error" not in r and not r["method"].startswith("DKM")}
    for r in data["rows"]:
        if "error" in r:
            rows.append([r["shape"], r["method"], *["-"] * 7, f"did not run: {r['error'][:80]}"])
            continue
        base = plain.get(r["shape"])
        ratio = f"{r['wall_s'] / base['wall_s']:.2f}" if base else "-"
        rows.append([f"{r['shape']} ({r['parameters'] / 1e6:,.0f}M)", r["method"], f"{r['wall_s']:.0f}",
                     f"{r['build']:.1f} ({r['kmeans']:.1f})", f"{r['train']:.1f}", f"{r['evaluate']:.1f}",
                     f"{r['save']:.1f}", f"{r['other_s']:.1f}", f"{r['peak_rss_mb'] / 1024:.1f}", ratio])  # fmt: skip
    return (
        "`python examples/run_clm.py` on a Llama shape built from scratch (bf16 weights and autocast, batch 1 x 128 "
        "tokens, 2 steps, `--save_strategy no`; its evaluations before and after training and its final save "
        "included), each job in a fresh process; the rest is the interpreter's start, the imports and the cached "
        "tokenized data:\n\n" + markdown_table(rows) + "\n\n" + measured({"recorded": data["measured"]})
    )  # the section's own record: a later run of another section rewrites the file's


SIZE_NAMES = {"issue": "issue's model", "1b": "~1B-parameter shape"}


@fragment("dkm_inference", "dkm_inference")
def dkm_inference(results: dict) -> str:
    """benchmarks/dkm_inference.py: generate speed, prefill and memory of ours against dense and 3-4 bit peers."""
    from areas.inference.report import heading, table

    data = results["dkm_inference"]
    cpu = data.get("cpu") or data["recorded"]["machine"].get("cpu") or "an unnamed CPU"
    parts = [f"On **{cpu}** (the loops its packed layers took are in the last column where the run recorded them):"]
    for size_name, size in data["sizes"].items():
        for threads in size["threads"]:
            parts.append(heading(size_name, size, threads, data["config"]) + "\n\n" + table(size, threads))
    missing = [name for name in ("issue", "1b") if name not in data["sizes"]]
    if missing and "--quick" not in data["argv"]:
        parts.append(f"Not part of this run: the {' and the '.join(SIZE_NAMES[m] for m in missing)} (`--sizes`).")
    verdict = "\n".join(f"- {line}" for line in data["verdicts"])
    threads = ", ".join(str(t) for t in data["config"]["threads"])
    return (
        "\n\n".join(parts) + "\n\nThe targets:\n\n" + verdict + "\n\n" + measured(data, f"{threads} torch thread(s)")
    )


@fragment("dkm_inference_loops", "dkm_inference_loops")
def dkm_inference_loops(results: dict) -> str:
    """benchmarks/dkm_inference.py --parts loops: every loop level of the DKM CPU kernel on each CPU measured."""
    from areas.inference.loops import kernel_rows, model_rows

    parts = []
    for cpu, part in results["dkm_inference_loops"]["machines"].items():
        k = part["kernels"]
        shape = part["shape"]
        parts.append(
            f"**{cpu}**, loop levels {', '.join(k['levels'])}. One packed "
            f"Linear {k['shape'][0]:,} x {k['shape'][1]:,} at batch 1, read from memory (the streaming floor: its "
            f"bytes at the {k['bandwidth_gb_s']:.1f} GB/s a plain sum streams here):\n\n"
            + kernel_rows(k)
            + f"\n\nThe issue's random Llama (hidden {shape['hidden']:,}, {shape['layers']} layers, MLP "
            f"{shape['intermediate']:,}), batch-1 `generate` of {part['new_tokens']} tokens, 1 torch thread, "
            f"{part['rounds']} round(s), each variant a fresh process per round, order rotated:\n\n"
            + model_rows(part, "1")
            + "\n\n"
            + "\n".join(f"- {line}" for line in part["verdicts"])
            + "\n\n"
            + measured(part, "1 torch thread")
        )
    return "\n\n".join(parts)


@fragment("dkm_inference_real", "dkm_inference_real")
def dkm_inference_real(results: dict) -> str:
    """benchmarks/dkm_inference.py --parts real: SmolLM2-135M against llama.cpp on each CPU measured."""
    from areas.inference.real import table

    parts = []
    for cpu, part in results["dkm_inference_real"]["machines"].items():
        for threads in part["threads"]:
            parts.append(
                f"**{cpu}**, SmolLM2-135M-Instruct ({part['layers']} layers), {threads} thread(s): greedy "
                f"`generate` of {part['new_tokens']} tokens after a prompt of real text, prefill of 512 tokens; "
                f"{part['rounds']} round(s), each variant a fresh process per round, order rotated; llama.cpp "
                f"built with {part['llama_cpp']}:\n\n" + table(part, threads)
            )
        parts.append("\n".join(f"- {line}" for line in part["verdicts"]) + "\n\n" + measured(part))
    return "\n\n".join(parts)


# -- CUDA: the same tables from the GPU check's results (benchmarks/gpu_check.py), rendered in docs/gpu.md -----------

CUDA_VARIANTS = ("moe_layers", "moe_summary", "dkm_speed", "sp_memory", "sp_time", "peft_llama", "quickstart")


def _on_cuda(name: str) -> None:
    """Registers `<name>.cuda`: fragment `name` rendered from the `.cuda` results files (`<file>.cuda.json`)."""
    files, render = FRAGMENTS[name].files, FRAGMENTS[name].render
    fragment(f"{name}.cuda", *(f"{file}.cuda" for file in files))(
        lambda results: render({file: results[f"{file}.cuda"] for file in files})
    )


for _name in CUDA_VARIANTS:
    _on_cuda(_name)


@fragment("gpu_check.cuda", "gpu_check.cuda")
def gpu_check(results: dict) -> str:
    """benchmarks/gpu_check.py: each part's status, seconds and budget in the last GPU check."""
    data = results["gpu_check.cuda"]
    rows = [["part", "status", "seconds", "budget s", "command"]]
    for name, row in data["parts"].items():
        command = f"`{row['command']}`" if row.get("command") else row.get("why", "")
        rows.append([name, row["status"], f"{row['seconds']:.0f}", f"{row['budget_s']:.0f}", command])
    head = f"The parts before the report, {data['seconds']:.0f} s of the check's {data['total_s']:.0f}:\n\n"
    return head + markdown_table(rows) + "\n\n" + measured(data)


@fragment("dkm_onnx", "dkm_onnx")
def dkm_onnx(results: dict) -> str:
    """benchmarks/dkm_onnx.py: onnxruntime serving of the DKM export against the dense ONNX export."""
    data = results["dkm_onnx"]
    titles = {"tiny": "tiny Llama (smoke test)", "issue": "Llama hidden 1,024, 8 layers, MLP 2,816, vocabulary 4,096",
              "smollm2": "SmolLM2-135M-Instruct (the real model, 30 layers)"}  # fmt: skip
    parts = []
    for size, cell in data["sizes"].items():
        rows = [["onnxruntime, 1 thread", "tokens/s batch 1", "x dense", "prefill s", "x dense",
                 "peak RSS over imports MiB", "x dense", "file MiB", "session load s"]]  # fmt: skip
        for name, v in cell["summary"].items():
            rows.append([name, f"{v['tokens_per_s_b1']:.2f}", f"{v['b1_x_dense']:.2f}", f"{v['prefill_s']:.2f}",
                         f"{v['prefill_x_dense']:.1f}", f"{v['peak_over_base_mib']:,.0f}", f"{v['peak_x_dense']:.2f}",
                         f"{v['file_mib']:,.1f}", f"{v['load_s']:.2f}"])  # fmt: skip
        config = data["config"]
        parts.append(
            f"{titles.get(size, size)}, DKM 3-bit (bf16 tables); batch-1 greedy tokens after a 16-token prompt "
            f"({config['new_tokens']} timed, {config['slow_tokens']} on the standard-op path), prefill of "
            f"{config['prefill']} tokens; {config['rounds']} round(s), a fresh process per variant and round, order "
            "rotated; every variant generated the PyTorch model's tokens:\n\n" + markdown_table(rows)
        )
    return "\n\n".join(parts) + "\n\n" + measured(data, "1 onnxruntime thread")
