"""Section (e) of benchmarks/dkm.py: DKM on the quickstart's trained causal LM, measured by perplexity.

The model is the one `python examples/run_clm.py` trains (tiny Llama on the embedded corpus). Pass its folder
with `--quickstart-model DIR`; otherwise a short run of the example's `run()` trains one into
benchmarks/results/dkm_quickstart (reused by later runs). Perplexity is computed on the example's own held-out
validation blocks (same tokenizer, block size, split and seed), at 3 and 4 bits: k-means only, DKM after a short
fine-tune on train blocks (bf16 latent weights), per-channel round-to-nearest and bitsandbytes nf4 / int8, plus
an fp32 control given the same fine-tune (a short-trained model still improves with more steps; DKM's recovery is
read against that control, not against the untouched fp32 model).
lm_head and the embeddings stay fp32 in every row (DKMConfig's and bitsandbytes' defaults), so bits/weight is over
the quantized Linear matrices and checkpoint MB is the whole safetensors file.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
import time
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEFAULT_DIR = Path(__file__).resolve().parent / "results" / "dkm_quickstart"


def _run_clm():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import run_clm

    return run_clm


def ensure_model(model_dir: Path | None, train_steps: int) -> Path:
    """The trained quickstart model: `model_dir` if given, else the cached short run (trained here if missing)."""
    if model_dir is not None:
        if not (Path(model_dir) / "config.json").is_file():
            raise ValueError(f"--quickstart-model {model_dir} has no config.json; pass a run_clm output folder")
        return Path(model_dir)
    if (DEFAULT_DIR / "model.safetensors").is_file():
        return DEFAULT_DIR
    argv = ["--output_dir", str(DEFAULT_DIR), "--max_steps", str(train_steps), "--save_strategy", "no"]
    argv += ["--overwrite_output_dir", "--disable_tqdm", "true", "--logging_steps", "50"]
    print(f"  quickstart: training the example for {train_steps} steps into {DEFAULT_DIR}", file=sys.stderr)
    _run_clm().run(argv)
    return DEFAULT_DIR


def _blocks(model_dir: Path, n_eval: int):
    """(tokenizer, train blocks, first `n_eval` validation blocks) exactly as the example builds them."""
    from transformers import AutoConfig

    from hf_llmkit.data.blocks import build_lm_datasets
    from hf_llmkit.data.corpus import corpus_texts, default_cache_dir

    clm = _run_clm()
    tok = clm.load_tokenizer(clm.ModelArguments(model_name_or_path=str(model_dir)))
    data_args = clm.DataArguments()
    datasets = build_lm_datasets(
        tokenizer=tok,
        block_size=clm.resolve_block_size(data_args, AutoConfig.from_pretrained(model_dir)),
        texts=corpus_texts(),
        validation_split_percentage=data_args.validation_split_percentage,
        cache_dir=default_cache_dir() / "datasets",
        seed=clm.EMBEDDED_DEFAULTS["seed"],
    )
    val = datasets["validation"]
    ids = lambda split: torch.tensor(split["input_ids"])  # noqa: E731
    return ids(datasets["train"]), ids(val.select(range(min(n_eval, len(val)))))


@torch.no_grad()
def _perplexity(model, blocks: torch.Tensor) -> float:
    model.eval()
    losses = [model(input_ids=b, labels=b).loss.float().item() for b in blocks.to(model.device).split(8)]
    weights = [len(b) for b in blocks.split(8)]  # equal-length blocks: block mean == token mean
    return math.exp(sum(loss * w for loss, w in zip(losses, weights)) / sum(weights))


def _finetune(model, train: torch.Tensor, steps: int) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    model.train()
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = train[torch.randint(len(train), (8,), generator=gen)].to(model.device)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def perplexity_table(tmp: Path, model_dir: Path, steps: int, n_eval: int, *, device: str = "cpu") -> list[dict]:
    """Rows of the quickstart table, every model on `device`."""
    from areas.dkm.helpers import bf16_latent, dkm_bits_per_weight, round_to_nearest, size_mb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_llmkit import DKMConfig
    from hf_llmkit.quantization import DKMLinear

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # int8 logs a cast warning on every matmul
    train, val = _blocks(model_dir, n_eval)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    linears = {n: m for n, m in base.named_modules() if type(m) is torch.nn.Linear and n != "lm_head"}
    numel = sum(m.weight.numel() for m in linears.values())
    fp32_mb = size_mb(model_dir)
    rows = [{"method": "fp32 (reference)", "bpw": 32.0, "ppl": _perplexity(base, val), "ckpt_mb": fp32_mb}]
    rows[0]["eval_blocks"] = len(val)

    def add(row: dict) -> None:
        rows.append(row)
        print(f"  quickstart: {row['method']}: perplexity {row['ppl']:.2f}", file=sys.stderr, flush=True)

    print(f"  quickstart: fp32 perplexity {rows[0]['ppl']:.2f} on {len(val)} blocks", file=sys.stderr)
    # Control: the same fine-tune without quantization, so the table separates recovery from extra training.
    control = copy.deepcopy(base)
    _finetune(control, train, steps)
    add(
        {
            "method": f"fp32 after the same {steps}-step fine-tune (control)",
            "bpw": 32.0,
            "ppl": _perplexity(control, val),
            "ckpt_mb": fp32_mb,
        }
    )
    del control
    for bits in (3, 4):
        model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=DKMConfig(bits=bits)).to(device)
        layers = bf16_latent(model, DKMLinear)  # bf16 latent weights, as in eDKM (and the MiniLM section)
        bpw = dkm_bits_per_weight(layers)
        model.save_pretrained(tmp / f"lm_kmeans{bits}")
        ckpt = size_mb(tmp / f"lm_kmeans{bits}")
        add(
            {"method": f"k-means only ({bits}-bit, ours)", "bpw": bpw, "ppl": _perplexity(model, val), "ckpt_mb": ckpt}
        )
        start = time.perf_counter()
        _finetune(model, train, steps)
        ppl = _perplexity(model, val)
        model.save_pretrained(tmp / f"lm_dkm{bits}")
        name = f"DKM {bits}-bit after {steps}-step fine-tune ({time.perf_counter() - start:.0f}s)"
        add({"method": name, "bpw": bpw, "ppl": ppl, "ckpt_mb": size_mb(tmp / f"lm_dkm{bits}")})
        rtn = copy.deepcopy(base)
        bpw_rtn, packed = round_to_nearest(rtn, bits, skip=("lm_head",))
        saved = (numel * 4 - packed) / 2**20
        add(
            {
                "method": f"round-to-nearest {bits}-bit per channel (size computed)",
                "bpw": bpw_rtn,
                "ppl": _perplexity(rtn, val),
                "ckpt_mb": fp32_mb - saved,
            }
        )
    row_scales = 32 * sum(m.weight.shape[0] for m in linears.values()) / numel
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    for name, cfg, bpw in [
        ("bitsandbytes nf4", nf4, 4.5),  # fp32 absmax per 64 weights
        ("bitsandbytes int8", BitsAndBytesConfig(load_in_8bit=True), 8 + row_scales),  # fp32 scale per row
    ]:
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=cfg, device_map=device)
            for m in model.modules():
                # bnb's AVX512-bf16 CPU repacking needs out_features % 32 == 0 and in_features % 64 == 0 (this
                # MLP is 688 wide); its generic dequantize path computes the same nf4 weights for every layer.
                if hasattr(m, "support_avx512bf16_for_cpu"):
                    m.support_avx512bf16_for_cpu = False
            ppl = _perplexity(model, val)
            model.save_pretrained(tmp / f"lm_{name.replace(' ', '_')}")
            add(
                {
                    "method": name,
                    "bpw": bpw,
                    "ppl": ppl,
                    "ckpt_mb": size_mb(tmp / f"lm_{name.replace(' ', '_')}"),
                }
            )
        except Exception as exc:  # noqa: BLE001 - report the peer as unavailable with the reason
            print(f"{name} failed on this machine: {exc!r}"[:300])
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n### (e) Quickstart causal LM: perplexity on {rows[0]['eval_blocks']} held-out validation blocks\n")
    print("| method | bits/weight (quantized matrices) | perplexity | vs fp32 | checkpoint MB |")
    print("|---|---:|---:|---:|---:|")
    ref = rows[0]["ppl"]
    for r in rows:
        print(f"| {r['method']} | {r['bpw']:.2f} | {r['ppl']:.2f} | {r['ppl'] / ref:.3f}x | {r['ckpt_mb']:.1f} |")
