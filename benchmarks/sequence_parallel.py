#!/usr/bin/env python
"""Ulysses sequence parallelism on CPU gloo ranks: activation memory per rank, tokens/s, longest sequence in budget.

For sp = 1, 2, 4 (1 = the plain model on one rank) a small Llama (GQA) runs forward + backward on one sequence per
length. Memory is the bytes of tensors autograd saves for backward (activations; parameters excluded, each storage
counted once), taken with `torch.autograd.graph.saved_tensors_hooks` -- torch has no CPU allocator statistics, and
process RSS mixes in the allocator's caching and the other ranks' share of a 2-core machine. The budget search
doubles then bisects the sequence length (multiples of 64) until the largest rank's saved activations exceed the
budget. The peer is DeepSpeed's HF Ulysses integration (`UlyssesSPAttentionHF`), set up through accelerate's
`ParallelismConfig(sp_backend="deepspeed")` on the same ranks, model and shards; when it cannot run here the
table says why.

    python benchmarks/sequence_parallel.py                # default run: a few minutes on 2 cores
    python benchmarks/sequence_parallel.py --lengths 1024 4096 --budget-mib 96
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hf_llmkit.parallel import (
    apply_sequence_parallel,
    new_sequence_parallel_groups,
    sequence_parallel_loss,
    shard_sequence_batch,
)
from hf_llmkit.testing import launch, tiny_llama

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
STEP = 64  # granularity of the longest-sequence search
MODEL = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1 << 17,
)


def _step(model, batch: dict, group) -> tuple[int, float]:
    """One forward + backward; returns (saved activation bytes, seconds)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
        logits = model(**inputs).logits
        if group is None:
            loss = torch.nn.functional.cross_entropy(logits[0].float(), batch["shift_labels"][0])
        else:
            loss = sequence_parallel_loss(logits, batch["shift_labels"], group=group)
    model.backward(loss) if hasattr(model, "backward") else loss.backward()  # a DeepSpeed engine wants its own
    model.zero_grad()
    return sum(saved.values()), time.perf_counter() - start


def _batch(seq: int, sp_rank: int, sp_size: int) -> dict:
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(3, MODEL["vocab_size"], (1, seq), generator=g)
    return shard_sequence_batch({"input_ids": ids, "labels": ids.clone()}, sp_rank=sp_rank, sp_size=sp_size)


def _max_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _measure(models: dict, group, sp_rank: int, sp_size: int, lengths: list[int], budget: int, repeats: int) -> dict:
    """Every model on the same shards; step times interleaved so machine noise hits all of them alike."""
    out = {name: {"rows": []} for name in models}
    for seq in lengths:
        batch = _batch(seq, sp_rank, sp_size)
        mem = {name: _step(model, batch, group)[0] for name, model in models.items()}  # also the warm-up
        best = dict.fromkeys(models, float("inf"))
        for _ in range(repeats):
            for name, model in models.items():
                best[name] = min(best[name], _step(model, batch, group)[1])
        for name in models:
            act = _max_over_ranks(mem[name]) / 2**20
            out[name]["rows"].append({"seq": seq, "act_mib": act, "tok_s": seq / _max_over_ranks(best[name])})
    for name, model in models.items():

        def fits(seq: int, model=model) -> bool:
            return _max_over_ranks(_step(model, _batch(seq, sp_rank, sp_size), group)[0]) <= budget

        low, high = 0, STEP * sp_size
        while fits(high):  # double until over budget, then bisect in steps of STEP tokens
            low, high = high, high * 2
        while high - low > STEP:
            mid = (low + high) // 2 // STEP * STEP
            low, high = (mid, high) if fits(mid) else (low, mid)
        out[name]["max_seq"] = low
    return out


def bench_rank(lengths: list[int], budget: int, repeats: int, peer: bool) -> dict:
    """One rank of a run with world = sp: ours (sp = 1: the plain model), and DeepSpeed's Ulysses when `peer`."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    ours = tiny_llama(seed=0, **MODEL).train()
    if world == 1:
        return _measure({"hf_llmkit": ours}, None, 0, 1, lengths, budget, repeats)
    groups = new_sequence_parallel_groups(sp_size=world)
    apply_sequence_parallel(ours, group=groups.sp_group)
    models, errors = {"hf_llmkit": ours}, {}
    if peer:
        try:
            models["deepspeed"] = deepspeed_ulysses(world)
        except Exception as err:  # the peer's own failure on this machine is a result, reported in the table
            errors["deepspeed"] = {"error": f"{type(err).__name__}: {err}"}
    return {**_measure(models, groups.sp_group, groups.sp_rank, world, lengths, budget, repeats), **errors}


def deepspeed_ulysses(world: int):
    """DeepSpeed's HF Ulysses through accelerate `ParallelismConfig(sp_backend="deepspeed")`: the prepared engine."""
    from accelerate import Accelerator, PartialState
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig

    # Without an accelerator, PartialState finds no DeepSpeed backend and reports 1 process: configure it on gloo.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")
    accelerator = Accelerator(
        parallelism_config=ParallelismConfig(sp_size=world, sp_backend="deepspeed", sp_handler=handler),
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config),
    )
    model = tiny_llama(seed=0, **MODEL).train()
    engine, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--budget-mib", type=float, default=24.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "sequence_parallel.json"))
    args = parser.parse_args()
    budget = int(args.budget_mib * 2**20)
    call = (args.lengths, budget, args.repeats)
    # launch() imports the rank function by module name: this file, importable as `sequence_parallel`
    sys.path.insert(0, str(HERE))
    bench = importlib.import_module("sequence_parallel")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    results: dict = {"config": {**MODEL, "budget_mib": args.budget_mib, "lengths": args.lengths}, "runs": {}}
    for sp in args.sp:
        got = launch(bench.bench_rank, *call, not args.no_peer, nprocs=sp, timeout=900, env=env)[0]
        for name, run in got.items():
            results["runs"][f"{name} sp={sp}"] = run
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


def print_table(results: dict) -> None:
    runs = results["runs"]
    base = runs.get("hf_llmkit sp=1")  # ratios against sp = 1 (the plain model on one rank) and, for the peer,

    def ours(name: str) -> dict | None:  # against hf_llmkit at the same sp
        return runs.get("hf_llmkit " + name.split(" ")[-1])

    print(f"\nsaved activations per rank and tokens/s, fwd+bwd, budget {results['config']['budget_mib']} MiB\n")
    print("| run | seq | act MiB/rank | vs sp=1 | tokens/s | vs sp=1 | peer/ours act | peer/ours tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, run in runs.items():
        if "error" in run:
            print(f"| {name} | - | cannot run: {run['error'][:300]} | | | | | |")
            continue
        mine = ours(name) if not name.startswith("hf_llmkit") else None
        for i, row in enumerate(run["rows"]):
            ref = base["rows"][i] if base else row
            vs = f"{row['act_mib'] / mine['rows'][i]['act_mib']:.2f} | " if mine else "| "
            vs += f"{row['tok_s'] / mine['rows'][i]['tok_s']:.2f}" if mine else ""
            print(
                f"| {name} | {row['seq']} | {row['act_mib']:.1f} | {row['act_mib'] / ref['act_mib']:.2f} | "
                f"{row['tok_s']:.0f} | {row['tok_s'] / ref['tok_s']:.2f} | {vs} |"
            )
    print("\n| run | longest sequence in budget | vs sp=1 |")
    print("|---|---|---|")
    for name, run in runs.items():
        if "error" not in run:
            ratio = run["max_seq"] / base["max_seq"] if base and base["max_seq"] else float("nan")
            print(f"| {name} | {run['max_seq']} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
