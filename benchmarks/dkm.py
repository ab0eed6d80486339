"""DKM / eDKM benchmark: ours vs coremltools' `DKMPalettizer` (speed, memory, init), eDKM memory.

    python benchmarks/dkm.py              # every section: a few minutes of (a)-(c) on a quiet 2-core machine, then
                                          # the quickstart LM (e)
    python benchmarks/dkm.py --quick      # (a)-(b) on one 256x256 layer, 2 rounds: seconds
    python benchmarks/dkm.py --device cuda  # the default when a GPU is present: every system on the GPU, timings
                                          # synchronized, memory = CUDA's allocator peak (max_memory_allocated)
    python benchmarks/dkm.py --peer-full  # the peer on the whole 4096x4096 layer (needs ~10 GB free at 4 bits)

(a) One training step (forward + backward + centroid update) of one Linear, 16 tokens, 3 DKM iterations each (our early
    stop off), at 3 and 4 bits, 1024x1024 and 4096x4096. Ours with fp32 latent weights (the default engine:
    interval at 1024x1024, bucketed at 4096x4096) and bf16 (eDKM's unique-value table); the peer with fp32 weights.
    Variants run interleaved, the order rotated each round (`harness.common.Bench`); the table gives min and median of
    the per-round speed-ups (peer seconds / ours). "Saved" = bytes autograd holds for backward (each storage once; the
    weight and the input are not counted), counted by the same saved-tensor hooks for every system. The peer saves
    ~330 / ~600 bytes per weight (3 / 4 bits), 5-10 GB on 4096x4096: there it runs on a slice of rows, scaled by
    rows / slice (its tensors are all [n, K]-shaped, so its saved bytes are exactly linear in n and its time is
    too), unless --peer-full.
(b) k-means initialisation of the tables: ours on 16M weights; the peer's (its first step minus a later one, with its
    fast `opt1d` init; its default k-means++ takes minutes).
(c) eDKM techniques (uniquify, shard, marshal) vs naive DKM on LLaMA-7B-shaped bf16 layers: benchmarks/dkm_memory.py.
(d) Quality per bit against real peers, on MiniLM and a causal LM: benchmarks/dkm_quality.py (its own script and
    results). (e) The quickstart LM: benchmarks/dkm_quickstart.py.

Writes benchmarks/results/dkm.json and dkm_speed.png / dkm_memory.png beside it; one torch thread; the machine
load is recorded before and after every measurement and printed under each table. On CUDA, "saved" in (a) becomes
the step's peak allocation above the parameters and the input (`harness.common.PeakMemory`), for every system alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness.common import (
    Bench,
    PeakMemory,
    add_device_argument,
    load_note,
    machine_state,
    markdown_table,
    pick_device,
    plot_lines,
    recorded_path,
    synchronize,
    synchronizer,
    write_results,
)

from hf_llmkit.quantization import MarshalHooks
from hf_llmkit.quantization.layers import DKMLinear, DKMSettings

TOKENS = 16
DKM_ITERS = 3


def _ours(rows: int, cols: int, bits: int, dtype: torch.dtype, device: torch.device):
    """(step, layer input, init seconds) of our DKM Linear (early stop off: all 3 iterations run, like the peer)."""
    torch.manual_seed(0)
    settings = DKMSettings.build(rows, bits=bits, dkm_iters=DKM_ITERS, epsilon=1e-12, offload=False)
    layer = DKMLinear(cols, rows, False, settings, device=device, dtype=dtype)
    torch.nn.init.normal_(layer.weight, std=0.02)
    synchronize(device)
    start = time.perf_counter()
    layer.init_centroids()
    synchronize(device)
    init = time.perf_counter() - start
    layer.train()
    x = torch.randn(TOKENS, cols).to(device=device, dtype=dtype)

    def step():
        layer.weight.grad = None
        layer(x).float().square().sum().backward()

    return step, x, init


def _peer(rows: int, cols: int, bits: int, device: torch.device):
    """(step, layer input, init seconds) of coremltools' DKMPalettizer on one Linear (fp32, its opt1d init)."""
    from coremltools.optimize.torch.palettization import (
        DKMPalettizer,
        DKMPalettizerConfig,
        ModuleDKMPalettizerConfig,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(cols, rows, bias=False, device=device))
    torch.nn.init.normal_(model[0].weight, std=0.02)
    config = ModuleDKMPalettizerConfig(n_bits=bits, kmeans_max_iter=DKM_ITERS, kmeans_init="opt1d")
    palettizer = DKMPalettizer(model, DKMPalettizerConfig(global_config=config))
    model = palettizer.prepare()
    model.train()
    x = torch.randn(TOKENS, cols).to(device)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        palettizer.step()

    first = time.perf_counter()
    step()  # the first step runs the k-means initialisation
    synchronize(device)
    first = time.perf_counter() - first
    later = time.perf_counter()
    step()
    synchronize(device)
    return step, x, max(0.0, first - (time.perf_counter() - later))


def _saved_bytes(step, x) -> float:
    """On CPU, bytes saved for backward by one step (each storage once; parameters and the input are not counted);
    on CUDA, the step's peak allocation above what existed before it (`max_memory_allocated`)."""
    if x.device.type == "cuda":
        with PeakMemory(x.device) as peak:
            step()
        return float(peak.peak_bytes)
    with MarshalHooks(offload=False, exclude=(x,)) as meter:
        step()
    return float(meter.stats.stored_bytes)


def compare(rows: int, cols: int, bits: int, rounds: int, peer_rows: int, device: torch.device) -> dict:
    """Section (a) + (b) for one layer shape and bit width."""
    scale = rows / peer_rows
    peer_step, peer_x, peer_init = _peer(peer_rows, cols, bits, device)
    ours = {
        name: _ours(rows, cols, bits, dtype, device)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }
    variants = {"peer": peer_step} | {name: step for name, (step, _, _) in ours.items()}
    timings = Bench(rounds=rounds, warmup=1, sync=synchronizer(device)).run(variants)
    peer_s = [t * scale for t in timings.seconds["peer"]]
    out = {
        "layer": f"{rows}x{cols}",
        "device": device.type,
        "bits": bits,
        "peer_rows": peer_rows,
        "scale": scale,
        "peer_seconds": peer_s,
        "peer_saved": _saved_bytes(peer_step, peer_x) * scale,
        "peer_init": peer_init,
        "timings": timings.to_json(),
        "note": load_note(timings.before, timings.after),
    }
    for name, (step, x, init) in ours.items():
        speedups = [p / t for p, t in zip(peer_s, timings.seconds[name])]
        saved = _saved_bytes(step, x)
        out[name] = {
            "seconds": timings.seconds[name],
            "speedup_min": min(speedups),
            "speedup_median": statistics.median(speedups),
            "saved": saved,
            "memory_ratio": out["peer_saved"] / max(saved, 1.0),
            "init": init,
        }
    return out


def print_speed(results: list[dict]) -> None:
    print("\n### (a) One DKM training step of one Linear vs coremltools DKMPalettizer (16 tokens, 3 iterations)\n")
    what = "peak MB" if results and results[0].get("device") == "cuda" else "saved MB"  # CUDA: allocator peak
    head = ["layer", "bits", "peer s/step", f"peer {what}", "ours", "s/step (median)", "speed-up min / median"]
    head += [what, f"peer {what.split()[0]} / ours"]
    rows = [head]
    for r in results:
        peer = f"{statistics.median(r['peer_seconds']):.3g}" + (
            f" (x{r['scale']:g} of a slice)" if r["scale"] != 1 else ""
        )
        for name in ("fp32", "bf16"):
            o = r[name]
            rows.append(
                [
                    r["layer"],
                    str(r["bits"]),
                    peer,
                    f"{r['peer_saved'] / 2**20:,.0f}",
                    f"hf_llmkit {name}",
                    f"{statistics.median(o['seconds']):.3g}",
                    f"{o['speedup_min']:.1f}x / {o['speedup_median']:.1f}x",
                    f"{o['saved'] / 2**20:,.2f}",
                    f"{o['memory_ratio']:,.0f}x",
                ]
            )
    print(markdown_table(rows))
    for r in results:
        print(f"\n{r['layer']}, {r['bits']} bits: {r['note']}")


def print_init(results: list[dict]) -> None:
    print("\n### (b) k-means table initialisation (seconds)\n")
    rows = [["layer", "bits", "ours fp32", "ours bf16", "peer (opt1d init, on the layer it ran)"]]
    for r in results:
        peer = f"{r['peer_init']:.2f}" + (f" ({r['peer_rows']} rows)" if r["scale"] != 1 else "")
        rows.append([r["layer"], str(r["bits"]), f"{r['fp32']['init']:.2f}", f"{r['bf16']['init']:.2f}", peer])
    print(markdown_table(rows))


def plot(results: list[dict]) -> list[Path | None]:
    speed, memory = {}, {}
    for bits in sorted({r["bits"] for r in results}):
        mine = [r for r in results if r["bits"] == bits]
        xs = [int(r["layer"].split("x")[0]) * int(r["layer"].split("x")[1]) for r in mine]
        for name in ("fp32", "bf16"):
            speed[f"{name}, {bits} bits (median)"] = (xs, [r[name]["speedup_median"] for r in mine])
            memory[f"{name}, {bits} bits"] = (xs, [r[name]["memory_ratio"] for r in mine])
    return [
        plot_lines(
            "dkm_speed",
            speed,
            xlabel="weights in the layer",
            ylabel="coremltools time / ours",
            title="DKM step speed-up over coremltools DKMPalettizer",
            logx=True,
            hline=5.0,
        ),
        plot_lines(
            "dkm_memory",
            memory,
            xlabel="weights in the layer",
            ylabel="coremltools saved bytes / ours",
            title="DKM memory saved for backward, coremltools / ours",
            logx=True,
            hline=10.0,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="(a)-(b) only, one 256x256 layer, 2 rounds")
    parser.add_argument("--peer-full", action="store_true", help="run the peer on the whole 4096x4096 layer")
    parser.add_argument("--only", nargs="*", default=None, choices=["speed", "memory", "quickstart"])
    parser.add_argument("--naive-rows", type=int, default=64, help="(c): rows of the naive slice (scaled linearly)")
    parser.add_argument("--quickstart-model", type=Path, default=None, help="(e): trained run_clm output folder")
    parser.add_argument("--quickstart-train-steps", type=int, default=200, help="(e): steps when training it here")
    parser.add_argument("--quickstart-finetune-steps", type=int, default=30, help="(e): DKM fine-tune steps")
    parser.add_argument("--quickstart-eval-blocks", type=int, default=40, help="(e): validation blocks")
    add_device_argument(parser)
    args = parser.parse_args()
    device = pick_device(args.device)
    torch.set_num_threads(1)  # shared machine: OpenMP spinning under load costs more than a second thread gives
    sections = set(args.only or (["speed"] if args.quick else ["speed", "memory", "quickstart"]))
    results: dict = {"argv": sys.argv[1:], "device": device.type, "machine_before": machine_state()}
    start = time.perf_counter()
    if "speed" in sections:
        big_slice = 4096 if args.peer_full else 1024
        plan = [(1024, 1024, 1024, 5), (4096, 4096, big_slice, 3)] if not args.quick else [(256, 256, 256, 2)]
        results["speed"] = [
            compare(r, c, bits, rounds, peer, device) for r, c, peer, rounds in plan for bits in (3, 4)
        ]
        print_speed(results["speed"])
        print_init(results["speed"])
        results["plots"] = [recorded_path(p) for p in plot(results["speed"]) if p is not None]
    if "memory" in sections:
        from dkm_memory import memory_cases, print_memory

        results["memory"] = memory_cases(args.naive_rows, device=device.type)
        print_memory(results["memory"])
    if "quickstart" in sections:
        import dkm_quickstart

        model_dir = dkm_quickstart.ensure_model(args.quickstart_model, args.quickstart_train_steps)
        with tempfile.TemporaryDirectory(prefix="dkm_bench_lm_") as tmp:
            rows = dkm_quickstart.perplexity_table(
                Path(tmp), model_dir, args.quickstart_finetune_steps, args.quickstart_eval_blocks, device=device.type
            )
        results["quickstart"] = {"model": recorded_path(model_dir), "rows": rows}
        dkm_quickstart.print_table(rows)
    results["machine_after"] = machine_state()
    results["seconds"] = time.perf_counter() - start
    out = write_results("dkm", results)
    print(
        f"\n{load_note(results['machine_before'], results['machine_after'])}; wrote {out} ({results['seconds']:.0f} s)"
    )


if __name__ == "__main__":
    main()
