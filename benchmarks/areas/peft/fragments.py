"""The docs fragments of `peft_methods.py`."""

from __future__ import annotations

from harness.common import markdown_table
from harness.registry import fragment, measured

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
