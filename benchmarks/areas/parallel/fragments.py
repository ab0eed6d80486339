"""The docs fragments of `sequence_parallel.py` (longest sequence, step time, offload bytes) and `moe.py`."""

from __future__ import annotations

import statistics

from harness.common import markdown_table
from harness.registry import fragment, measured, pair

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
