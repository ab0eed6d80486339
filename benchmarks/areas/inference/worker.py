"""One variant of benchmarks/dkm_inference.py in a process of its own: prepare its checkpoint, or load it and measure.

`run(mode, spec, out)` is the target of a child process: on CPU a fork of the benchmark, which imported torch,
transformers, hf_llmkit and the installed peers once (`areas.inference.variants.preimport`: on a loaded 2-core machine
an import of transformers with torchao installed takes tens of seconds), on CUDA a spawned one. A process per variant
and round keeps each one's memory its own: the resident size at its start (the shared imports) is its base, the
kernel's high-water mark (`VmHWM`) its peak, reset after loading through `/proc/self/clear_refs` so that the
inference peak is measured apart from the load's. A peer that cannot run here raises; `measure` then writes
`{"error": "<one line>"}`, which the benchmark records. The builders of every variant live in
`areas/inference/variants.py`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, the root of these imports

from harness.process_memory import reset_peak, status_kib  # noqa: E402

from areas.inference import variants  # noqa: E402


def _timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _prompts(spec: dict, device) -> tuple[dict, torch.Tensor]:
    """Batch-1 and batch-8 prompts and the prefill input: `spec["text_ids"]` (real text, the real-model part) or
    random ids below the vocabulary."""
    if spec.get("text_ids"):
        ids = torch.tensor(spec["text_ids"])
        prompt = ids[: spec["prompt"]].unsqueeze(0)
        long = ids[: spec["prefill"]].unsqueeze(0).to(device)
        return {1: prompt.to(device), 8: prompt.repeat(8, 1).to(device)}, long
    generator = torch.Generator().manual_seed(0)
    vocab = min(spec["shape"]["vocab"], 4096)
    prompt = {b: torch.randint(3, vocab, (b, spec["prompt"]), generator=generator).to(device) for b in (1, 8)}
    return prompt, torch.randint(3, vocab, (1, spec["prefill"]), generator=generator).to(device)


def measure(spec: dict) -> dict:
    """Load the variant, warm up, then time `repeats` times: batch-1 (and unless `spec["batch8"]` is False batch-8)
    greedy `generate` of `new_tokens` tokens after a `prompt`-token prompt, and one prefill forward of `prefill`
    tokens. `spec["loops"]` caps the packed layers' CPU kernel to those loops; `spec["cache"]` / `spec["compile"]`
    generate with transformers' static cache / a `torch.compile`d forward; `spec["split"]` also times, in one more
    generate, the modules that multiply by weights (the kernel time; the rest of a token's time is the framework's)."""
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    if spec.get("loops"):
        from hf_llmkit.quantization import _lut_native

        _lut_native.cap_loops(spec["loops"])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    base_rss = status_kib("VmRSS")
    start = time.perf_counter()
    prompt, long = _prompts(spec, device)
    if spec["kind"] == "llama_cpp":
        from areas.inference import llamacpp as llama

        try:
            return llama.measure(spec, prompt[1][0].tolist(), long[0].tolist())
        except llama.Unavailable as e:
            raise variants.Unavailable(str(e)) from e
    model = variants.load(spec)
    load_s = time.perf_counter() - start
    loaded_rss, load_peak = status_kib("VmRSS"), status_kib("VmHWM")
    reset = reset_peak()
    n = spec["new_tokens"]
    options = {"cache_implementation": "static"} if spec.get("cache") == "static" else {}
    if spec.get("compile"):
        model.forward = torch.compile(model.forward, dynamic=False)

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
                **options,
            )
        if out.shape != (batch, ids.shape[1] + tokens):
            raise RuntimeError(f"generate returned shape {tuple(out.shape)}, not {(batch, ids.shape[1] + tokens)}")
        return out

    def prefill():
        with torch.inference_mode():
            model(input_ids=long, logits_to_keep=1)

    batches = (1, 8) if spec.get("batch8", True) else (1,)
    for batch in batches:  # warm-up: every shape the timed calls take (decoding at each batch size, the prefill)
        generate(batch, 2 if not options and not spec.get("compile") else n)
    prefill()
    times: dict[str, list[float]] = {f"generate_b{b}": [] for b in batches} | {"prefill": []}
    tokens = []
    for _ in range(spec["repeats"]):
        times["generate_b1"].append(_timed(lambda: tokens.append(generate(1)), sync))
        if 8 in batches:
            times["generate_b8"].append(_timed(lambda: generate(8), sync))
        times["prefill"].append(_timed(prefill, sync))
    weights = variants.weight_bytes(model)
    result = {
        "times": times,
        "tokens_per_s_b1": [n / t for t in times["generate_b1"]],
        "weight_bytes": weights["model"],
        "decoder_weight_bytes": weights["decoder"],
        "load_s": load_s,
        "rss_base_mib": base_rss / 1024,
        "rss_loaded_mib": loaded_rss / 1024,
        "peak_rss_load_mib": load_peak / 1024,
        "peak_rss_inference_mib": status_kib("VmHWM") / 1024 if reset else None,
        "peak_rss_mib": max(load_peak, status_kib("VmHWM")) / 1024,
        "first_tokens": tokens[0][0, prompt[1].shape[1] :].tolist()[:8],
        "modules": variants.describe(model),
        "dkm_paths": variants.dkm_paths(),
        "loops": variants.loops_taken(model, spec),
    }
    if 8 in batches:
        result["tokens_per_s_b8"] = [8 * n / t for t in times["generate_b8"]]
    if spec.get("split"):
        result["kernel_s_per_token"] = [variants.kernel_seconds(model, lambda: generate(1)) / n]
    if spec.get("text_ids"):  # real text: the perplexity of the prefill's tokens (untimed), a check on the weights
        with torch.inference_mode():
            result["perplexity"] = math.exp(model(input_ids=long, labels=long).loss.float().item())
    return result


def run(mode: str, spec: dict, out: str) -> None:
    """The child process: `prepare` writes the variant's checkpoint; `measure` writes its measurements (or its
    one-line error) as JSON to `out`. Peers' log folders go to the work folder, not the caller's."""
    os.chdir(Path(out).parent)
    if mode == "prepare":
        variants.prepare(spec)
        Path(out).write_text("{}")
        return
    if mode == "kernels":  # part loops' kernel table (torch work: never in the parent, whose children are forks)
        from areas.inference import loops

        Path(out).write_text(json.dumps(loops.kernel_table(spec["quick"])))
        return
    if mode == "switch":  # part loops' prefill switch table (torch work too)
        from areas.inference import switch

        Path(out).write_text(json.dumps(switch.switch_table(spec["quick"])))
        return
    if mode == "real_setup":  # part real: the SmolLM2 folder (built once into the cache) and the prompt's ids
        from areas.inference import llamacpp, real
        from hf_llmkit.testing import smollm2_path

        folder = smollm2_path(num_hidden_layers=2 if spec["quick"] else None)
        ids = real.text_ids(folder, spec["tokens"])
        layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
        setup = dict(folder=str(folder), ids=ids, layers=layers, llama_cpp=llamacpp.system_info())
        Path(out).write_text(json.dumps(setup))
        return
    try:
        if spec["kind"] == "onnx":  # onnxruntime rows: areas/inference/onnxrt.py
            from areas.inference.onnxrt import measure as onnx_measure

            result = onnx_measure(spec)
        else:
            result = measure(spec)
    except variants.Unavailable as e:
        result = {"error": str(e)}
    except Exception as e:  # a peer that breaks at run time: its one line, the traceback on stderr
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"}
    Path(out).write_text(json.dumps(result))
