"""Mixture of experts: hf_llmkit's `MoELayer` vs transformers' Mixtral sparse block vs DeepSpeed's `MoE`.

Part 1, layer speed. One forward + backward of each system at H 256, I 1,024, top-2, fp32 (`--hidden`, `--inter`,
`--dtype`), relative to the floor:
a dense SwiGLU MLP of the same width applied twice (top-2 routing does two MLPs' work per token). Systems, all
loaded with the same weights: `MoELayer` dropless (and with capacity factor 1.0, for reference); transformers'
`MixtralSparseMoeBlock` with each experts implementation that runs on CPU (eager, grouped_mm, and batched_mm when
its per-token weight copies fit in `--batched-mm-gib`); DeepSpeed's `MoE` dropless and with capacity factor 1.0.
One more row runs ours on torch's ops (`TORCH_OPS`: what the C SwiGLU and routing kernels are worth), and one runs
our expert compute inside transformers' own `MixtralSparseMoeBlock` through its experts registry
(`experts_implementation="llmkit"`, `REGISTRY`: the block `upcycle_to_moe` returns), next to grouped_mm in the same
block, transformers' default. Each
configuration runs at 1 and 2 torch threads over an expert sweep (8, 16, 64 experts at 2,048 tokens) and a
token sweep (512, 2,048, 8,192 tokens at 8 experts), with `harness.common.Bench`: variants interleaved, order rotated
each round, min and median of per-round ratios, load average before and after. Outputs and gradients of `MoELayer`
and DeepSpeed are checked against Mixtral eager on the same input.

Part 2, upcycling: a tiny Llama is upcycled (`upcycle_to_moe`, 8 experts, top-2) and trained with `LLMKitTrainer`
on the embedded corpus with and without the load-balancing loss; reports the final loss and the max/min expert
load ratio of the last logging window.

    python benchmarks/moe.py --quick   # 8 experts, 512 tokens, 2 rounds, no training: seconds
    python benchmarks/moe.py           # the full grid and the training part: ~6 minutes on 2 idle cores

`--device cuda` (the default when a GPU is present) runs every system on the GPU, timings synchronized.

Writes benchmarks/results/moe.json and, per thread count, moe_experts_<n>thr.png and moe_tokens_<n>thr.png
(time / floor against experts and against tokens).
The Mixtral block's experts implementation is chosen with the public `experts_implementation` config argument.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from harness.common import (
    Bench,
    add_device_argument,
    markdown_table,
    pick_device,
    plot_lines,
    synchronizer,
    write_results,
)
from torch import nn

from hf_llmkit.parallel import MoELayer
from hf_llmkit.parallel.moe import dispatch, swiglu_kernel
from hf_llmkit.parallel.moe.grad_buffers import GradientBuffer
from hf_llmkit.testing import corpus_texts, corpus_tokenizer, distributed_backend, free_port, tiny_llama_config

FLOOR, OURS = "dense MLP x2 (floor)", "hf_llmkit MoELayer dropless"
# Ours on torch ops instead of the C SwiGLU and routing kernels (CPU, float32): what the kernels are worth.
TORCH_OPS = f"{OURS}, torch ops"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EVEN = "E dense MLPs, even rows (no routing)"
# Our expert compute in transformers' own block, through its ExpertsInterface registry; grouped_mm is its default.
REGISTRY, GROUPED_MM = "hf_llmkit experts in the Mixtral block (llmkit)", "Mixtral block grouped_mm"
TRAFFIC = "E experts' weight traffic only"


class SwiGLU(nn.Module):
    """The dense MLP (and DeepSpeed's expert): `down(silu(gate x) * up x)`."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class EvenExperts(nn.Module):
    """Top-2 work at E experts without routing: each token twice, rows split evenly over E separate dense MLPs.

    A second reference besides the floor: it pays what E experts cost whatever the router does (E weight sets
    streamed through small matmuls, E weight gradients written), so `ours / this` is the routing overhead.
    """

    def __init__(self, hidden: int, inter: int, experts: int):
        super().__init__()
        self.experts = nn.ModuleList(SwiGLU(hidden, inter) for _ in range(experts))

    def forward(self, x):
        rows = torch.cat([x, x], dim=-2).reshape(-1, x.shape[-1])  # [2T, H]
        outs = [expert(chunk) for expert, chunk in zip(self.experts, rows.chunk(len(self.experts)))]
        return torch.cat(outs).view(*x.shape[:-2], 2, x.shape[-2], -1).sum(-3)


class _StreamWeights(torch.autograd.Function):
    """Forward reads every weight once; backward reads them again and writes their gradients (into reused memory,
    as `MoELayer` does). No arithmetic beyond that: what moving E experts' weights costs, whatever computes."""

    @staticmethod
    def forward(ctx, x, buffers, *weights):
        ctx.save_for_backward(*weights)
        ctx.buffers = buffers
        for w in weights:
            w.sum()
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grads = [torch.mul(w, 0.5, out=b.empty_like(w)) for w, b in zip(ctx.saved_tensors, ctx.buffers)]
        return grad, None, *grads


class WeightTraffic(nn.Module):
    """The memory traffic of E experts' weights in one forward + backward, timed as a fraction of the floor.

    The dense floor holds one MLP's weights (3 MiB at H 256, I 1,024: they stay in cache); E experts hold E times
    that, which every expert implementation streams from memory twice and writes as gradients once per step. Where
    this reference is a sizeable fraction of the floor (64 experts; few tokens per expert), no MoE reaches the floor.
    """

    def __init__(self, hidden: int, inter: int, experts: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * inter, hidden))
        self.down = nn.Parameter(torch.randn(experts, hidden, inter))
        self.buffers = (GradientBuffer(), GradientBuffer())

    def forward(self, x):
        return _StreamWeights.apply(x, self.buffers, self.gate_up, self.down)


def mixtral_block(shape: dict, implementation: str, state: dict) -> nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=shape["hidden"], intermediate_size=shape["inter"], num_local_experts=shape["experts"],
        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, experts_implementation=implementation,
    )  # fmt: skip
    block = MixtralSparseMoeBlock(config)
    block.load_state_dict(state)
    return block


def deepspeed_moe(shape: dict, *, drop_tokens: bool, state: dict) -> nn.Module:
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE

    if not dist.is_initialized():  # DeepSpeed's MoE needs a process group, even for one rank
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group(distributed_backend(1), rank=0, world_size=1)  # + NCCL for CUDA tensors on a GPU
    hidden, inter = shape["hidden"], shape["inter"]
    layer = MoE(
        hidden, SwiGLU(hidden, inter), num_experts=shape["experts"], k=2, capacity_factor=1.0,
        eval_capacity_factor=1.0, drop_tokens=drop_tokens, use_rts=False, top2_2nd_expert_sampling=False,
    )  # fmt: skip
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(state["gate.weight"])
        for e, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            expert.gate_proj.weight.copy_(state["experts.gate_up_proj"][e, :inter])
            expert.up_proj.weight.copy_(state["experts.gate_up_proj"][e, inter:])
            expert.down_proj.weight.copy_(state["experts.down_proj"][e])
    return layer


def batched_mm_gib(shape: dict) -> float:
    """Mixtral batched_mm copies both expert matrices per routed token, kept for backward and again as gradients."""
    per_row = 3 * shape["inter"] * shape["hidden"] * DTYPES[shape.get("dtype", "fp32")].itemsize
    return 2 * shape["tokens"] * 2 * per_row / 2**30


def build_systems(shape: dict, *, batched_mm_budget: float, deepspeed: bool) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    hidden, inter, experts = shape["hidden"], shape["inter"], shape["experts"]
    ours = MoELayer(hidden, inter, num_experts=experts, top_k=2)
    state = ours.state_dict()
    capacity = MoELayer(hidden, inter, num_experts=experts, top_k=2, capacity_factor=1.0)
    capacity.load_state_dict(state)
    systems = {FLOOR: SwiGLU(hidden, inter), EVEN: EvenExperts(hidden, inter, experts), OURS: ours}
    systems[TORCH_OPS] = MoELayer(hidden, inter, num_experts=experts, top_k=2)
    systems[TORCH_OPS].load_state_dict(state)
    systems[TRAFFIC] = WeightTraffic(hidden, inter, experts)
    systems["hf_llmkit MoELayer capacity 1.0"] = capacity
    implementations = ["eager", "grouped_mm"] + (["batched_mm"] if batched_mm_gib(shape) <= batched_mm_budget else [])
    for impl in implementations:
        systems[f"Mixtral block {impl}"] = mixtral_block(shape, impl, state)
    systems[REGISTRY] = mixtral_block(shape, "llmkit", state)
    if deepspeed:
        systems["DeepSpeed MoE dropless"] = deepspeed_moe(shape, drop_tokens=False, state=state)
        systems["DeepSpeed MoE capacity 1.0"] = deepspeed_moe(shape, drop_tokens=True, state=state)
    return systems


def forward(name: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out  # DeepSpeed: (out, l_aux, exp_counts)
    if name == FLOOR:  # top-2 work is two dense MLP passes over the tokens
        out = out + module(x)
    return out


@contextlib.contextmanager
def undone(name: str):
    """`TORCH_OPS`: ours on torch's ops, without the C kernels, for the duration (forward and backward)."""
    serves, routing = swiglu_kernel.serves, dispatch.kernel_serves
    if name == TORCH_OPS:
        swiglu_kernel.serves, dispatch.kernel_serves = (lambda h: False), (lambda *tensors: False)
    try:
        yield
    finally:
        swiglu_kernel.serves, dispatch.kernel_serves = serves, routing


def step(name: str, module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        inp = x.detach().requires_grad_(True)
        with undone(name):
            forward(name, module, inp).square().mean().backward()
        module.zero_grad(set_to_none=True)

    return run


def check_outputs(systems: dict[str, nn.Module], x: torch.Tensor) -> dict[str, dict[str, float]]:
    """Largest difference of each MoE system's output and input gradient from Mixtral eager's."""
    ref_name = "Mixtral block eager"
    results = {}
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(x)
    outs = {}
    for name in (ref_name, OURS, REGISTRY, "DeepSpeed MoE dropless"):
        if name in systems:
            inp = x.detach().requires_grad_(True)
            out = forward(name, systems[name], inp)
            (out * grad_out).sum().backward()
            outs[name] = (out.detach(), inp.grad)
            systems[name].zero_grad(set_to_none=True)
    for name, (out, grad) in outs.items():
        if name != ref_name:
            ref_out, ref_grad = outs[ref_name]
            results[name] = {
                "output": (out - ref_out).abs().max().item(),
                "grad_input": (grad - ref_grad).abs().max().item(),
            }
    return results


def ratio_stats(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return {"min": min(ratios), "median": statistics.median(ratios)}


def bench_config(shape: dict, threads: int, args) -> dict:
    torch.set_num_threads(threads)
    device, sync = pick_device(args.device), synchronizer(args.device)
    dtype = DTYPES[args.dtype]
    with device:  # the weights are made where they run (64 experts at GPU sizes: no minutes of CPU init)
        systems = build_systems(shape, batched_mm_budget=args.batched_mm_gib, deepspeed=not args.no_deepspeed)
    systems = {name: module.to(device=device, dtype=dtype) for name, module in systems.items()}
    if torch.device(device).type != "cpu" or dtype != torch.float32:  # where the C kernel does not serve
        del systems[TORCH_OPS]
    x = torch.randn(1, shape["tokens"], shape["hidden"], generator=torch.Generator().manual_seed(1))
    x = x.to(device=device, dtype=dtype)
    diffs = check_outputs(systems, x)
    steps = {name: step(name, module, x) for name, module in systems.items()}
    once = {name: _time_once(fn, sync) for name, fn in steps.items()}  # also a warm-up
    # A system far slower than the floor (Mixtral eager at 64 experts: ~25x) would take most of the run: one call
    # is enough to rank it, and it is reported from that call.
    slow = {n: t / once[FLOOR] for n, t in once.items() if is_peer(n) and t > args.slow_cutoff * once[FLOOR]}
    timings = Bench(rounds=args.rounds, warmup=args.warmup, sync=sync).run(
        {name: fn for name, fn in steps.items() if name not in slow}, baseline=FLOOR
    )
    secs = timings.seconds
    vs_peers = {p: ratio_stats(secs[OURS], secs[p]) for p in secs if is_peer(p)}
    for p in slow:  # ranked from the one call each (ours's untimed call too)
        vs_peers[p] = {"min": once[OURS] / once[p], "median": once[OURS] / once[p], "single_call": True}
    label = f"{shape['experts']} experts, {shape['tokens']} tokens, {threads} thread{'s' * (threads > 1)}"
    print(f"\n### {label}\n\n{timings.table(title='system (fwd+bwd)')}")
    for name, ratio in slow.items():
        print(f"{name}: {ratio:.1f}x the floor in one call (> --slow-cutoff {args.slow_cutoff}; not timed further)")
    if batched_mm_gib(shape) > args.batched_mm_gib:
        need, budget = batched_mm_gib(shape), args.batched_mm_gib
        print(f"Mixtral batched_mm skipped: it needs ~{need:.0f} GiB (> --batched-mm-gib {budget})")
    print("max |diff| vs Mixtral eager: " + ", ".join(f"{n}: {d}" for n, d in diffs.items()))
    vs_even = ratio_stats(secs[OURS], secs[EVEN])
    vs_undone = {TORCH_OPS: ratio_stats(secs[OURS], secs[TORCH_OPS])} if TORCH_OPS in secs else {}
    registry = {}
    if GROUPED_MM in secs:  # ours in transformers' block against its default in the same block, and against MoELayer
        registry = {
            "grouped_mm": ratio_stats(secs[REGISTRY], secs[GROUPED_MM]),
            "moe_layer": ratio_stats(secs[REGISTRY], secs[OURS]),
        }
        print(
            f"{REGISTRY} / {GROUPED_MM}: {registry['grouped_mm']['min']:.3f} / {registry['grouped_mm']['median']:.3f}"
        )
    return {
        **shape, "threads": threads, "timings": timings.to_json(), "ours_vs_peers": vs_peers, "ours_vs_even": vs_even,
        "ours_vs_undone": vs_undone, "registry": registry, "diffs": diffs, "slow_single_call_vs_floor": slow,
    }  # fmt: skip


def is_peer(name: str) -> bool:
    return name.startswith(("Mixtral", "DeepSpeed"))


def _time_once(fn: Callable[[], None], sync: Callable[[], None] | None) -> float:
    start = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - start


def summary_table(results: list[dict]) -> str:
    """One row per configuration: ours and the weight traffic against the floor, ours against the E-even reference,
    the closest dropless peer and DeepSpeed with capacity 1.0 (which drops rows, so does less work)."""
    rows = [["experts", "tokens", "threads", "ours / floor", "traffic / floor", "ours / E even",
             "ours / best dropless peer", "best dropless peer", "ours / DS capacity 1.0", "load"]]  # fmt: skip
    pair = lambda d: f"{d['min']:.3f} / {d['median']:.3f}"  # noqa: E731
    for r in results:
        summary = r["timings"]["summary"]
        floor, traffic = summary[OURS], summary[TRAFFIC]
        dropless = {p: v for p, v in r["ours_vs_peers"].items() if "capacity" not in p}
        best = max(dropless, key=lambda p: dropless[p]["median"])  # the closest competitor
        best_name = best + " (one call)" * bool(dropless[best].get("single_call"))
        capacity = r["ours_vs_peers"].get("DeepSpeed MoE capacity 1.0")
        load = f"{r['timings']['machine_before']['load_1min']:.1f}->{r['timings']['machine_after']['load_1min']:.1f}"
        rows.append(
            [str(r["experts"]), str(r["tokens"]), str(r["threads"]),
             f"{floor['ratio_min']:.3f} / {floor['ratio_median']:.3f}",
             f"{traffic['ratio_min']:.3f} / {traffic['ratio_median']:.3f}", pair(r["ours_vs_even"]),
             pair(dropless[best]), best_name, pair(capacity) if capacity else "-", load]
        )  # fmt: skip
    return markdown_table(rows)


def plot_sweep(results: list[dict], key: str, fixed: dict, threads: int) -> None:
    """`results/moe_{key}_{threads}thr.png`: median time / floor of every system along one sweep."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in results:
        if r["threads"] != threads or any(r[k] != v for k, v in fixed.items()):
            continue
        ratios = {name: row["ratio_median"] for name, row in r["timings"]["summary"].items() if name != FLOOR}
        ratios.update(r["slow_single_call_vs_floor"])
        for name, ratio in ratios.items():
            xs, ys = series.setdefault(name, ([], []))
            xs.append(r[key])
            ys.append(ratio)
    if not any(len(xs) > 1 for xs, _ in series.values()):
        return  # a single point is no curve
    (what,) = fixed.values()
    other = "tokens" if key == "experts" else "experts"
    title = f"MoE fwd+bwd / two dense MLP passes ({other} = {what}, {threads} thread(s), median of rounds)"
    path = plot_lines(
        f"moe_{key}_{threads}thr", series, xlabel=key, ylabel="time / floor (log)", title=title, logx=True,
        logy=True, hline=1.0,
    )  # fmt: skip
    if path:
        print(f"plot: {path}")


def train_upcycled(steps: int, aux_coef: float, device: str) -> dict:
    from transformers import LlamaForCausalLM, PrinterCallback

    from hf_llmkit import LLMKitTrainingArguments
    from hf_llmkit.data.blocks import build_lm_datasets
    from hf_llmkit.parallel import upcycle_to_moe
    from hf_llmkit.trainers import LLMKitTrainer

    tokenizer = corpus_tokenizer()
    data = build_lm_datasets(tokenizer=tokenizer, block_size=64, texts=corpus_texts()[:400])["train"]
    torch.manual_seed(0)
    dense = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id))
    model = upcycle_to_moe(dense, num_experts=8, top_k=2)
    with tempfile.TemporaryDirectory() as out:
        targs = LLMKitTrainingArguments(
            out, max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3, warmup_steps=2,
            logging_steps=max(steps // 4, 1), report_to=[], save_strategy="no", disable_tqdm=True,
            use_cpu=device == "cpu", seed=0, moe_aux_loss_coef=aux_coef, moe_z_loss_coef=0.001,
        )  # fmt: skip
        trainer = LLMKitTrainer(model=model, args=targs, train_dataset=data)
        trainer.remove_callback(PrinterCallback)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    logs = [e for e in trainer.state.log_history if "loss" in e]
    last = logs[-1]
    # the logged loss includes the weighted auxiliary losses: report the language-model part
    lm_loss = last["loss"] - aux_coef * last["moe_aux_loss"] - 0.001 * last["moe_z_loss"]
    return {
        "moe_aux_loss_coef": aux_coef,
        "final_lm_loss": lm_loss,
        "load_max_min_ratio": last["moe_load_max_min_ratio"],
        "ratio_per_window": [e["moe_load_max_min_ratio"] for e in logs],
        "train_seconds": seconds,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 experts, 512 tokens, 1 thread, 2 rounds, no training")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--experts", default="8,16,64", help="expert sweep (at 2,048 tokens)")
    parser.add_argument("--tokens", default="512,2048,8192", help="token sweep (at 8 experts)")
    parser.add_argument("--fixed-tokens", type=int, default=2048, help="tokens of the expert sweep")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=1024, help="each expert's (and the floor's) intermediate size")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weights and activations")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batched-mm-gib", type=float, default=4.0, help="memory allowed for Mixtral batched_mm")
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--slow-cutoff", type=float, default=6.0, help="systems slower than this x floor: one call")
    parser.add_argument("--train-steps", type=int, default=30, help="upcycling part (0 = skip)")
    parser.add_argument("--aux-coef", type=float, default=0.01, help="balancing-loss weight of the 'with' run")
    add_device_argument(parser)
    args = parser.parse_args()
    pick_device(args.device)  # exit code 2 now, not after minutes of work, when CUDA is asked for and absent
    if args.quick:
        args.threads, args.experts, args.tokens, args.rounds, args.train_steps = "1", "8", "512", 2, 0
        args.fixed_tokens = 512
    return args


def main() -> None:
    args = parse_args()
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    fixed = args.fixed_tokens  # the expert sweep's token count
    configs = [(e, fixed) for e in ints(args.experts)] + [(8, t) for t in ints(args.tokens) if (8, t) != (8, fixed)]
    results = []
    for threads in ints(args.threads):
        for experts, tokens in configs:
            shape = {"hidden": args.hidden, "inter": args.inter, "experts": experts, "tokens": tokens}
            shape["dtype"] = args.dtype
            results.append(bench_config(shape, threads, args))
    write_results("moe", {"config": vars(args), "layers": results, "upcycled_training": []})  # kept if the rest fails
    print("\n### MoELayer dropless: ratios (min / median of per-round ratios)\n")
    print(summary_table(results))
    for threads in ints(args.threads):
        plot_sweep(results, "experts", {"tokens": fixed}, threads)
        plot_sweep(results, "tokens", {"experts": 8}, threads)
    training = []
    if args.train_steps:
        training = [train_upcycled(args.train_steps, c, args.device) for c in (0.0, args.aux_coef)]
        print(f"\n### Upcycled tiny Llama (8 experts, top-2), {args.train_steps} LLMKitTrainer steps\n")
        rows = [["moe_aux_loss_coef", "final LM loss", "max/min expert load (last window)", "per window", "seconds"]]
        for t in training:
            windows = ", ".join(f"{v:.2f}" for v in t["ratio_per_window"])
            rows.append([str(t["moe_aux_loss_coef"]), f"{t['final_lm_loss']:.3f}", f"{t['load_max_min_ratio']:.2f}",
                         windows, f"{t['train_seconds']:.0f}"])  # fmt: skip
        print(markdown_table(rows))
    path = write_results("moe", {"config": vars(args), "layers": results, "upcycled_training": training})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
