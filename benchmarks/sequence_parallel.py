#!/usr/bin/env python
"""Long sequences on CPU gloo ranks: the longest trainable sequence in a fixed memory budget, and step time, for
Ulysses sequence parallelism x the ALST switches, against DeepSpeed's Ulysses and DeepSpeed's ALST pieces.

For sp = 1, 2, 4 (world = sp; sp = 1 is the model on one rank) a small Llama (GQA, see MODEL) trains on one sequence:
- hf_llmkit plain: no switch (at sp = 1 the plain HF model: the baseline of every "x sp=1" ratio);
- hf_llmkit ckpt: transformers' activation checkpointing;
- hf_llmkit tiled: tiled loss + tiled MLP (CHUNK positions per chunk), no checkpointing;
- hf_llmkit alst: checkpointing + tiled loss + tiled MLP + activation-checkpoint offload (what
  `offload_activation_checkpoints` asks for: transformers' per-checkpoint `offload=True`, which copies each layer's
  input to host memory, host to host on CPU);
- deepspeed ulysses (sp > 1): DeepSpeed's `UlyssesSPAttentionHF` through accelerate `ParallelismConfig`;
- deepspeed alst: DeepSpeed's Ulysses (sp > 1) + its `TiledMLP` and `TiledFusedLogitsLoss` + checkpointing.

Memory is the peak, over one forward + backward, of the bytes of all tensors alive at once that the step created
(`harness.tensor_memory.TensorMemory`: every storage an operator returns -- activations saved for backward, transients
such as logits and their gradients, recomputation, collective buffers -- counted until it is freed), on the rank with
the largest peak. Gradients count as they are allocated (set to None before each step, as `Trainer` does);
parameters do not, nor a kernel's internal scratch buffers or allocator caching: it is the CPU counterpart of
CUDA's `max_memory_allocated` minus the parameters (and an optimizer's state, not involved here). The
longest sequence is the largest multiple of 64 * sp tokens whose peak stays within `--budget-mib`: found by growing
(at most x4 a step) from the probe length, then closing the bracket with affine interpolation and bisection
(`areas.parallel.longest_search`), never above the length at which the embedding output alone fills the budget.

The losses of all variants at the first probe length are compared (they agree to fp32 rounding), and at sp = 1 the
norm of each variant's LM-head weight gradient against the plain model's. DeepSpeed's ALST differs:
its `TiledFusedLogitsLoss` computes the LM head's weight gradient inside its forward, so a scale applied to its
output afterwards (the token mean here, gradient accumulation, fp16 loss scaling) reaches the hidden states'
gradient but not the head's -- ours (checkpointed chunks) gives the untiled gradients.

Step time: every variant at `--time-seq` tokens, in interleaved rounds with the order rotated each round
(`harness.common.Bench`), each round's time the slowest rank's; min and median of per-round ratios.

Offload bytes (one rank, `--offload-seq` tokens, checkpointing on, plain LM loss): what each activation-offload
design copies to host memory in one step (`areas.parallel.offload_bytes.moved_bytes`: bytes written by `aten.copy_`
with the design minus without; on an accelerator they cross to the host in the forward and back in the backward) --
hf_llmkit's `offload_activation_checkpoints` (transformers' per-checkpoint `offload=True`), DeepSpeed's
`CheckpointHiddenStatesOffload` (marked checkpoint inputs, the last one kept on the device; it skips tensors that
are not on an accelerator), and `offload_saved_activations()` around the whole forward (what the trainer did
before: everything autograd saves outside the checkpointed layers too, the logits included). Deterministic: it
does not depend on the load. `--offload-only` runs this part alone.

    python benchmarks/sequence_parallel.py --quick     # sp 2, 8 MiB, 256 tokens, 2 rounds, forked ranks: a smoke test
    python benchmarks/sequence_parallel.py --offload-only   # the offload bytes alone (seconds)
    python benchmarks/sequence_parallel.py             # sp 1, 2, 4, 32 MiB: about 30 minutes
    python benchmarks/sequence_parallel.py --device cuda --budget-mib 4096   # one GPU per rank, over NCCL

On CUDA (the default when a GPU is present) each rank runs on its own GPU (sp values above the GPU count are left
out), memory is the allocator's peak (`torch.cuda.max_memory_allocated` above the parameters,
`harness.common.PeakMemory`), timings synchronize, and the ALST offload really copies checkpointed activations to the
host.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from areas.parallel.longest_search import Longest, longest_within  # noqa: E402
from harness.common import (  # noqa: E402
    Bench,
    PeakMemory,
    add_device_argument,
    load_note,
    machine_state,
    markdown_table,
    pick_device,
    plot_lines,
    synchronizer,
    write_results,
)

from hf_llmkit.parallel import new_sequence_parallel_groups, shard_sequence_batch  # noqa: E402
from hf_llmkit.parallel.sequence import (  # noqa: E402
    TiledLoss,
    TiledMLP,
    apply_sequence_parallel,
    offload_saved_activations,
    sequence_parallel_loss,
    sequence_parallel_mean,
)
from hf_llmkit.parallel.sequence.data import IGNORE_INDEX  # noqa: E402
from hf_llmkit.parallel.sequence.tiled_loss import TARGETS_KWARG  # noqa: E402
from hf_llmkit.testing import launch, tiny_llama  # noqa: E402

MODEL = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1 << 18,
)
# `--model 1b`: a Llama-1B-like shape (TinyLlama's: 22 layers there, 16 here; about 1.1B parameters), for one GPU
MODELS = {
    "tiny": MODEL,
    "1b": dict(MODEL, vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=4),
}  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_RUN = {"model": MODEL, "dtype": torch.float32}  # this rank's model shape and dtype, set by bench_rank
CHUNK = 256  # positions per tiled-loss / tiled-MLP chunk, ours and DeepSpeed's
OURS = ("plain", "ckpt", "tiled", "alst")


def _device() -> torch.device:
    """This rank's device: its own GPU (set by `launch` when there is one per rank) when the run is on CUDA."""
    return torch.device("cuda", torch.cuda.current_device()) if _DEVICE["type"] == "cuda" else torch.device("cpu")


_DEVICE = {"type": "cpu"}  # set once per rank by bench_rank


def _model() -> torch.nn.Module:
    """The benchmark's Llama on this rank's device in the run's dtype, made there (a 1B model: no CPU init)."""
    with _device():
        return tiny_llama(seed=0, **_RUN["model"]).to(_RUN["dtype"]).train()


def _batch(seq: int, sp_rank: int, sp_size: int) -> dict:
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(3, _RUN["model"]["vocab_size"], (1, seq), generator=g)
    shard = shard_sequence_batch({"input_ids": ids, "labels": ids.clone()}, sp_rank=sp_rank, sp_size=sp_size)
    return {key: value.to(_device()) for key, value in shard.items()}


def _mean(total: torch.Tensor, targets: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        return sequence_parallel_mean(total, targets, group=group)
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)


def _ours(switches: str, group) -> callable:
    """One of our variants: a step function (fwd + bwd on a shard) returning the loss."""
    model = _model()
    if group is not None:
        apply_sequence_parallel(model, group=group)
    if switches in ("ckpt", "alst"):  # alst: offload_activation_checkpoints = transformers' offload=True, where it
        # runs (a CPU-only torch build has no pinned memory: checkpointing without offload, as the job does there)
        model.activation_checkpointing_enable(offload=switches == "alst" and transformers_offload_runs())
    if switches in ("tiled", "alst"):
        TiledLoss(model, chunk_size=CHUNK)
        TiledMLP(model, chunk_size=CHUNK)

    def step(batch: dict) -> float:
        inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
        targets = batch["shift_labels"]
        if switches in ("tiled", "alst"):
            loss = _mean(model(**inputs, **{TARGETS_KWARG: targets}).loss, targets, group)
        elif group is not None:
            loss = sequence_parallel_loss(model(**inputs).logits, targets, group=group)
        else:
            loss = F.cross_entropy(model(**inputs).logits[0].float(), targets[0], ignore_index=IGNORE_INDEX)
        loss.backward()
        _note_head_grad(f"hf_llmkit {switches}", model)
        model.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _deepspeed(switches: str, group, world: int) -> callable:
    """DeepSpeed's Ulysses (sp > 1) and, for "alst", its TiledMLP / TiledFusedLogitsLoss + checkpointing."""
    from areas.parallel import deepspeed_alst as peer

    model = _model()
    if switches == "alst":
        model.activation_checkpointing_enable()
        peer.deepspeed_tiled_mlp(model, chunk_size=CHUNK)
    engine = peer.deepspeed_ulysses(model, world) if world > 1 and switches == "ulysses" else None
    if world > 1 and switches == "alst" and not peer.ulysses_is_registered():
        raise RuntimeError("DeepSpeed's Ulysses is not registered (the deepspeed ulysses peer failed to start)")
    module = engine.module if engine is not None else model

    def step(batch: dict) -> float:
        inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
        targets = batch["shift_labels"]
        if switches == "alst":
            loss = _mean(peer.deepspeed_tiled_loss_sum(module, inputs, targets, chunk_size=CHUNK), targets, group)
        else:
            loss = sequence_parallel_loss(engine(**inputs).logits, targets, group=group)
        engine.backward(loss) if engine is not None else loss.backward()
        _note_head_grad(f"deepspeed {switches}", module)
        module.zero_grad(set_to_none=True)
        return loss.item()

    return step


_HEAD_GRADS: dict[str, float] = {}  # variant -> norm of its LM head's weight gradient, noted while "on"
_NOTE = {"on": False}


def _note_head_grad(name: str, model: torch.nn.Module) -> None:
    grad = model.lm_head.weight.grad
    if _NOTE["on"]:
        _HEAD_GRADS[name] = grad.float().norm().item() if grad is not None else float("nan")


def _max_over_ranks(values: list[float]) -> list[float]:
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _peak(step, seq: int, sp_rank: int, sp_size: int) -> int:
    batch = _batch(seq, sp_rank, sp_size)
    with PeakMemory(_device()) as mem:
        step(batch)
    return int(_max_over_ranks([mem.peak_bytes])[0])


def _longest(step, budget: int, sp_rank: int, sp_size: int, probe: int) -> Longest:
    """The longest multiple of 64 * sp tokens whose peak fits `budget` (`areas.parallel.longest_search`), searched up
    to the length at which one [tokens per rank, hidden] activation alone (the embedding output) fills the budget."""
    cap = sp_size * budget // (_RUN["model"]["hidden_size"] * _RUN["dtype"].itemsize)
    peak_of = partial(_peak, step, sp_rank=sp_rank, sp_size=sp_size)
    return longest_within(peak_of, budget, unit=64 * sp_size, start=probe, cap=cap)


def bench_rank(config: dict) -> dict:
    """One rank of a run with world = sp: memory search then interleaved timing of every variant."""
    torch.set_num_threads(config["threads"])
    _DEVICE["type"] = config["device"]
    _RUN.update(model=MODELS[config.get("model", "tiny")], dtype=DTYPES[config.get("dtype", "fp32")])
    world = dist.get_world_size()
    groups = new_sequence_parallel_groups(sp_size=world) if world > 1 else None
    group, sp_rank = (groups.sp_group, groups.sp_rank) if groups else (None, 0)
    steps = {f"hf_llmkit {name}": _ours(name, group) for name in OURS}
    errors = {}
    for name in ("ulysses", "alst") if config["peer"] else ():
        if name == "ulysses" and world == 1:
            continue
        try:
            steps[f"deepspeed {name}"] = _deepspeed(name, group, world)
        except Exception as err:  # the peer's own failure here is a result, reported in the table
            errors[f"deepspeed {name}"] = f"{type(err).__name__}: {err}"
    probe = config["probe"] * world
    _NOTE["on"] = True  # the first step of each variant: its loss and its LM head's weight gradient
    losses = {name: _max_over_ranks([step(_batch(probe, sp_rank, world))])[0] for name, step in steps.items()}
    _NOTE["on"] = False
    # sp = 1 only: on more ranks each rank's gradient is a partial sum, which DeepSpeed's engine reduces and ours
    # leaves to DDP, so the norms would not compare
    head_grads = {name: _HEAD_GRADS[name] / _HEAD_GRADS["hf_llmkit plain"] for name in steps} if world == 1 else {}
    memory = {}
    for name, step in steps.items() if config["memory"] else ():
        found = _longest(step, config["budget"], sp_rank, world, probe)
        peak = found.peaks.get(probe) or _peak(step, probe, sp_rank, world)
        memory[name] = {"max_seq": found.length, "capped": found.capped, "runs": found.runs, "peak_at_probe": peak}
    batch = _batch(config["time_seq"], sp_rank, world)
    variants = {name: partial(step, batch) for name, step in steps.items()}
    timings = Bench(rounds=config["rounds"], warmup=1, sync=synchronizer(_device())).run(variants)
    seconds = {name: _max_over_ranks(ts) for name, ts in timings.seconds.items()}  # the slowest rank, per round
    return {
        "losses": losses,
        "head_grad_vs_plain": head_grads,
        "memory": memory,
        "seconds": seconds,
        "machine": [timings.before, timings.after],
        "errors": errors,
    }


def forked_ranks(fn, config: dict, *, nprocs: int, timeout: float) -> list:
    """`launch(fn, config, nprocs=...)`'s results with ranks forked from this process (gloo on 127.0.0.1), for a smoke
    run (`--fork-ranks`: this process ran torch on one thread, so a fork is safe); a rank that fails gives the others
    2 s, then every rank left is killed and the run stops with the exit codes."""
    import pickle
    import signal
    import tempfile
    import time
    import traceback

    from hf_llmkit.testing import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="sp_ranks_") as tmp:
        pids = []
        for rank in range(nprocs):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    world = str(nprocs)
                    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
                    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                    dist.init_process_group("gloo")
                    result = fn(config)
                    dist.barrier()
                    dist.destroy_process_group()
                    Path(tmp, f"result{rank}.pkl").write_bytes(pickle.dumps(result))
                    code = 0
                except BaseException:  # noqa: BLE001 - the rank's traceback, then its exit status
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            pids.append(pid)
        codes: dict[int, int] = {}
        deadline, failed_at = time.monotonic() + timeout, None
        while len(codes) < nprocs:
            for pid in pids:
                done, status = os.waitpid(pid, os.WNOHANG) if pid not in codes else (0, 0)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            if failed_at is None and any(codes.values()):
                failed_at = time.monotonic()
            if len(codes) < nprocs and (
                time.monotonic() > deadline or (failed_at and time.monotonic() > failed_at + 2)
            ):
                for pid in pids:
                    if pid not in codes:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        codes[pid] = -signal.SIGKILL
            time.sleep(0.02)
        if any(codes.values()):
            raise RuntimeError(f"{fn.__qualname__} on {nprocs} forked ranks: exit codes {[codes[p] for p in pids]}")
        return [pickle.loads(Path(tmp, f"result{rank}.pkl").read_bytes()) for rank in range(nprocs)]


def transformers_offload_runs() -> bool:
    """Whether transformers' `offload=True` runs on this torch build: it pins host memory for the current accelerator,
    or for the CPU where torch reports none (a CPU-only build), whose pinning raises "pin_memory=True requires a CUDA
    or other accelerator backend" (a CUDA build without a GPU still names cuda, and copies host to host)."""
    try:
        return torch.accelerator.current_accelerator() is not None
    except RuntimeError:
        return False


NO_PINNED_MEMORY = (
    "not run: transformers' offload=True keeps activations in pinned host memory, which a torch build without an "
    "accelerator cannot allocate (offload_activation_checkpoints checkpoints without offload there)"
)
OFFLOAD_DESIGNS = {
    "hf_llmkit offload_activation_checkpoints (transformers' offload=True)": "transformers",
    "DeepSpeed CheckpointHiddenStatesOffload": "deepspeed",
    "offload_saved_activations() around the forward (the trainer's design before)": "whole_forward",
}


def offload_bytes(seq: int, device: torch.device) -> dict:
    """Bytes each offload design copies to host memory in one step of the benchmark's model on one sequence."""
    from areas.parallel.offload_bytes import moved_bytes

    _DEVICE["type"] = device.type
    ids = torch.randint(3, MODEL["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0)).to(device)

    def checkpointed(offload: bool = False) -> torch.nn.Module:
        model = _model()
        model.activation_checkpointing_enable(offload=offload)
        return model

    def step(model: torch.nn.Module, context=None) -> None:
        with context if context is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    plain = checkpointed()
    designs = {
        "transformers": (lambda: step(checkpointed(offload=True)))
        if transformers_offload_runs()
        else RuntimeError(NO_PINNED_MEMORY),
        "whole_forward": lambda: step(plain, offload_saved_activations(include_cpu=True, min_bytes=0)),
    }
    try:
        from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

        pinned = device.type != "cpu"
        designs["deepspeed"] = lambda: step(plain, CheckpointHiddenStatesOffload(use_pin_memory=pinned))
    except ImportError as err:  # the peer is optional (the deepspeed extra)
        designs["deepspeed"] = err
    hidden = seq * MODEL["hidden_size"] * torch.float32.itemsize  # one layer input [1, S, H]
    rows = {}
    for name, key in OFFLOAD_DESIGNS.items():
        design = designs[key]
        if isinstance(design, Exception):
            rows[name] = {"error": f"{type(design).__name__}: {design}"}
            continue
        moved = moved_bytes(lambda: step(plain), design)
        rows[name] = {"bytes": moved, "x_layer_input": moved / hidden}
    return {"seq": seq, "layers": MODEL["num_hidden_layers"], "device": device.type, "designs": rows}


def report_offload(offload: dict) -> None:
    from areas.parallel.offload_bytes import offload_rows

    print(
        f"\n## Bytes copied to host memory per step ({offload['seq']} tokens, {offload['layers']} layers, "
        f"{offload['device']})\n"
    )
    print(markdown_table(offload_rows(offload["designs"])))


def _ratio(seconds: dict, a: str, b: str) -> str:
    if a not in seconds or b not in seconds:
        return "-"
    per_round = [x / y for x, y in zip(seconds[a], seconds[b])]
    return f"{min(per_round):.2f} / {statistics.median(per_round):.2f}"


def report(results: dict) -> None:
    runs, config = results["runs"], results["config"]
    if not config.get("alst_offloads", True):
        print("hf_llmkit alst: checkpointing without offload (this torch build has no pinned host memory)")
    if config["memory"]:
        report_memory(runs, config)
    report_time(runs, config)
    for sp, run in runs.items():
        loss = run["losses"]
        spread = max(loss.values()) - min(loss.values())
        print(f"sp={sp}: losses of all variants at {config['probe'] * int(sp)} tokens agree within {spread:.2e}")
        ratios = ", ".join(f"{name} {r:.3g}" for name, r in run["head_grad_vs_plain"].items())
        if ratios:
            print(f"sp={sp}: LM-head weight-gradient norm / the plain model's: {ratios}")
        for name, err in run["errors"].items():
            print(f"sp={sp}: {name} cannot run: {err[:300]}")


def report_memory(runs: dict, config: dict) -> None:
    base = runs["1"]["memory"]["hf_llmkit plain"]["max_seq"] if "1" in runs else None  # --sp without 1: no ratio
    rows = [["variant", *[f"sp={sp} longest" for sp in runs], *[f"sp={sp} x plain sp=1" for sp in runs]]]
    names = list(dict.fromkeys(name for run in runs.values() for name in run["memory"]))
    for name in names:
        got = [runs[sp]["memory"].get(name, {}) for sp in runs]
        cells = [(">=" * bool(g.get("capped")) + str(g["max_seq"])) if g.get("max_seq") else "-" for g in got]
        ratios = [f"{g['max_seq'] / base:.2f}x" if g.get("max_seq") and base else "-" for g in got]  # base 0: none fit
        rows.append([name, *cells, *ratios])
    print(f"\n## Longest sequence within {config['budget_mib']:g} MiB of peak tensor memory per rank\n")
    print(markdown_table(rows))
    print(
        f"\n(peak bytes of tensors alive at once during fwd+bwd, gradients included, parameters not; largest rank; "
        f"tiles of {CHUNK} positions; on CPU the offload copies host to host)"
    )


def report_time(runs: dict, config: dict) -> None:
    print(f"\n## Step time at {config['time_seq']} tokens (fwd+bwd; min / median of per-round ratios)\n")
    rows = [["sp", "variant", "median s", "x hf_llmkit plain", "ours / deepspeed (same switches)"]]
    for sp, run in runs.items():
        seconds = run["seconds"]
        for name in seconds:
            peer = {"hf_llmkit plain": "deepspeed ulysses", "hf_llmkit alst": "deepspeed alst"}.get(name, "")
            rows.append(
                [sp, name, f"{statistics.median(seconds[name]):.3f}", _ratio(seconds, name, "hf_llmkit plain"),
                 _ratio(seconds, name, peer) if peer else ""]
            )  # fmt: skip
    print(markdown_table(rows))
    for sp, run in runs.items():
        print(f"sp={sp}: {load_note(*run['machine'])} (x{sp} ranks, {config['threads']} torch thread(s) each)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--budget-mib", type=float, default=None, help="(default: 32 on CPU, 4096 on CUDA)")
    parser.add_argument("--probe", type=int, default=512, help="tokens per rank of the first memory probe")
    parser.add_argument("--time-seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny", help="the Llama shape (MODELS)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weights and activations")
    parser.add_argument("--time-only", action="store_true", help="skip the longest-sequence search")
    parser.add_argument("--quick", action="store_true",
                        help="sp 2, 8 MiB, 256 tokens timed, 2 rounds, ranks forked (--fork-ranks)")  # fmt: skip
    parser.add_argument("--fork-ranks", action="store_true",
                        help="a smoke run: on CPU with one torch thread, the ranks forked from this process instead "
                        "of fresh interpreters (their imports: seconds each)")  # fmt: skip
    parser.add_argument("--offload-seq", type=int, default=4096, help="tokens of the offload-bytes step")
    parser.add_argument("--offload-only", action="store_true", help="only the offload bytes (seconds)")
    add_device_argument(parser)
    args = parser.parse_args()
    device = pick_device(args.device)
    if args.budget_mib is None:
        args.budget_mib = 4096.0 if device.type == "cuda" else 32.0
    if args.quick:
        args.sp, args.budget_mib, args.probe, args.time_seq, args.rounds = [2], 8.0, 64, 256, 2
        args.fork_ranks = True
    if device.type == "cuda" and any(sp > torch.cuda.device_count() for sp in args.sp):
        print(f"--device cuda: one GPU per rank; sp > {torch.cuda.device_count()} left out", file=sys.stderr)
        args.sp = [sp for sp in args.sp if sp <= torch.cuda.device_count()]
    config = {
        "budget": int(args.budget_mib * 2**20),
        "budget_mib": args.budget_mib,
        "probe": args.probe,
        "time_seq": args.time_seq,
        "rounds": args.rounds,
        "threads": args.threads,
        "peer": not args.no_peer,
        "memory": not args.time_only,
        "device": device.type,
        "model": args.model,
        "dtype": args.dtype,
        "alst_offloads": transformers_offload_runs(),  # False: alst checkpoints without offload (no pinned memory)
    }
    offload = offload_bytes(256 if args.quick else args.offload_seq, device)
    report_offload(offload)
    print(f"wrote {write_results('sequence_parallel_offload', offload)}")
    if args.offload_only:
        return
    bench = importlib.import_module("sequence_parallel")  # launch() imports the rank function by module name
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    shape = {"model": MODELS[args.model], "model_name": args.model, "chunk": CHUNK}
    results = {"config": {**config, **shape}, "machine": machine_state(), "runs": {}}
    for sp in args.sp:
        if args.fork_ranks and device.type == "cpu" and torch.get_num_threads() == 1:
            results["runs"][str(sp)] = forked_ranks(bench.bench_rank, config, nprocs=sp, timeout=3600)[0]
        else:
            results["runs"][str(sp)] = launch(bench.bench_rank, config, nprocs=sp, timeout=3600, env=env)[0]
    report(results)
    if not config["memory"]:
        print(f"\nwrote {write_results('sequence_parallel_time', results)}")
        return
    names = list(dict.fromkeys(name for run in results["runs"].values() for name in run["memory"]))
    series: dict[str, tuple[list[int], list[int]]] = {}
    for name in names:
        runs = [(int(sp), run["memory"][name]) for sp, run in results["runs"].items() if name in run["memory"]]
        points = ([sp for sp, _ in runs], [got["max_seq"] for _, got in runs])
        same = next((label for label, other in series.items() if other == points), None)  # lines that coincide
        if same is not None:
            series[f"{same} = {name}"] = series.pop(same)
        else:
            series[name] = points
    png = plot_lines(
        "sequence_parallel", series, xlabel="sequence-parallel ranks (sp)", ylabel="longest sequence (tokens)",
        title=f"Longest trainable sequence in {args.budget_mib:g} MiB per rank ({device.type}, {args.model} Llama)",
        logx=True,
    )  # fmt: skip
    print(f"\nwrote {write_results('sequence_parallel', results)}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
