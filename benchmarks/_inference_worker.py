"""One variant of benchmarks/dkm_inference.py in a process of its own: prepare its checkpoint, or load it and measure.

`run(mode, spec, out)` is the target of a child process: on CPU a fork of the benchmark, which imported torch,
transformers, hf_llmkit and the installed peers once (`_inference_variants.preimport`: on a loaded 2-core machine an
import of transformers with torchao installed takes tens of seconds), on CUDA a spawned one. A process per variant
and round keeps each one's memory its own: the resident size at its start (the shared imports) is its base, the
kernel's high-water mark (`VmHWM`) its peak, reset after loading through `/proc/self/clear_refs` so that the
inference peak is measured apart from the load's. A peer that cannot run here raises; `measure` then writes
`{"error": "<one line>"}`, which the benchmark records. The builders of every variant live in `_inference_variants.py`.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _inference_variants as variants  # noqa: E402


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """Reset the kernel's resident high-water mark (VmHWM) of this process; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def measure(spec: dict) -> dict:
    """Load the variant, warm up, then time `repeats` times: batch-1 and batch-8 greedy `generate` of
    `new_tokens` tokens after a `prompt`-token prompt, and one prefill forward of `prefill` tokens."""
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    base_rss = _status_kib("VmRSS")
    start = time.perf_counter()
    model = variants.load(spec)
    load_s = time.perf_counter() - start
    loaded_rss, load_peak = _status_kib("VmRSS"), _status_kib("VmHWM")
    reset = _reset_peak()
    generator = torch.Generator().manual_seed(0)
    vocab = min(spec["shape"]["vocab"], 4096)
    prompt = {b: torch.randint(3, vocab, (b, spec["prompt"]), generator=generator).to(device) for b in (1, 8)}
    long = torch.randint(3, vocab, (1, spec["prefill"]), generator=generator).to(device)
    n = spec["new_tokens"]

    def generate(batch: int, tokens: int = n):
        ids = prompt[batch]
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )
        if out.shape != (batch, spec["prompt"] + tokens):
            raise RuntimeError(f"generate returned shape {tuple(out.shape)}, not {(batch, spec['prompt'] + tokens)}")
        return out

    def prefill():
        with torch.inference_mode():
            model(input_ids=long, logits_to_keep=1)

    generate(1, 2)  # warm-up: every shape the timed calls take (decoding at batch 1 and 8, the prefill)
    generate(8, 2)
    prefill()
    times: dict[str, list[float]] = {"generate_b1": [], "generate_b8": [], "prefill": []}
    tokens = []
    for _ in range(spec["repeats"]):
        times["generate_b1"].append(_timed(lambda: tokens.append(generate(1)), sync))
        times["generate_b8"].append(_timed(lambda: generate(8), sync))
        times["prefill"].append(_timed(prefill, sync))
    weights = variants.weight_bytes(model)
    return {
        "times": times,
        "tokens_per_s_b1": [n / t for t in times["generate_b1"]],
        "tokens_per_s_b8": [8 * n / t for t in times["generate_b8"]],
        "weight_bytes": weights["model"],
        "decoder_weight_bytes": weights["decoder"],
        "load_s": load_s,
        "rss_base_mib": base_rss / 1024,
        "rss_loaded_mib": loaded_rss / 1024,
        "peak_rss_load_mib": load_peak / 1024,
        "peak_rss_inference_mib": _status_kib("VmHWM") / 1024 if reset else None,
        "peak_rss_mib": max(load_peak, _status_kib("VmHWM")) / 1024,
        "first_tokens": tokens[0][0, spec["prompt"] :].tolist()[:8],
        "modules": variants.describe(model),
        "dkm_paths": variants.dkm_paths(),
    }


def run(mode: str, spec: dict, out: str) -> None:
    """The child process: `prepare` writes the variant's checkpoint; `measure` writes its measurements (or its
    one-line error) as JSON to `out`. Peers' log folders go to the work folder, not the caller's."""
    os.chdir(Path(out).parent)
    if mode == "prepare":
        variants.prepare(spec)
        Path(out).write_text("{}")
        return
    try:
        if spec["kind"] == "onnx":  # onnxruntime rows: _inference_onnx.py
            from _inference_onnx import measure as onnx_measure

            result = onnx_measure(spec)
        else:
            result = measure(spec)
    except variants.Unavailable as e:
        result = {"error": str(e)}
    except Exception as e:  # a peer that breaks at run time: its one line, the traceback on stderr
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"}
    Path(out).write_text(json.dumps(result))
