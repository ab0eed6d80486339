"""onnxruntime variants of the DKM inference benchmarks (benchmarks/dkm_inference.py rows, benchmarks/dkm_onnx.py).

`prepare(spec)` writes the variant's file into `spec["dir"]`: the DKM checkpoint of `spec["bits"]` /
`spec["options"]` (as ours) exported with `export_onnx`, packed or `dense=True` (the decoded float32 weights: the
dense ONNX export users would otherwise serve). `measure(spec)` opens it in this fresh process, with our C kernel
(`onnxruntime_session`, `spec["onnx_kernel"]`) or onnxruntime's standard ops, one intra-op thread per torch thread,
and measures what `areas.inference.worker.measure` measures for a PyTorch model, with `greedy_generate` over the
exported cache: batch-1 and batch-8 greedy tokens/s after a warm-up (over `spec["onnx_tokens"]` tokens where given:
the standard-op path decodes every weight per call), one prefill forward, the initializer bytes (whole model and
decoder layers) and the peak resident memory over the imports.
"""

from __future__ import annotations

import time
from pathlib import Path

from harness.process_memory import reset_peak, status_kib

FILE = "model.onnx"


def prepare(spec: dict) -> None:
    from transformers import AutoModelForCausalLM

    from hf_llmkit import DKMConfig
    from hf_llmkit.quantization import export_onnx

    out = Path(spec["dir"])
    config = DKMConfig(bits=spec["bits"], **spec["options"])
    model = AutoModelForCausalLM.from_pretrained(spec["dense_dir"], quantization_config=config)
    model.eval().save_pretrained(out / "checkpoint")
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    export_onnx(model, out / "exported", dense=spec["onnx_file"] == "dense")


def initializer_bytes(path: Path) -> dict[str, int]:
    """Bytes of the file's initializers (inline or external), whole model and decoder layers (`.layers.` names)."""
    import onnx

    def size(tensor) -> int:
        external = {e.key: e.value for e in tensor.external_data}
        return int(external["length"]) if "length" in external else onnx.numpy_helper.to_array(tensor).nbytes

    graph = onnx.load(str(path), load_external_data=False).graph
    sizes = {i.name: size(i) for i in graph.initializer}
    return {"model": sum(sizes.values()), "decoder": sum(v for n, v in sizes.items() if ".layers." in n)}


def measure(spec: dict) -> dict:
    import numpy as np
    import onnxruntime
    import onnxruntime_extensions  # noqa: F401  (imported by every variant: the base excludes it)
    import torch

    from hf_llmkit.quantization.export import greedy_generate, onnxruntime_session

    torch.set_num_threads(spec["threads"])
    path = Path(spec["dir"]) / "exported" / FILE
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = spec["threads"], 1
    base = status_kib("VmRSS")
    started = time.perf_counter()
    if spec["onnx_kernel"]:
        session = onnxruntime_session(path, options)
    else:
        session = onnxruntime.InferenceSession(str(path), options)
    load_s = time.perf_counter() - started
    loaded, load_peak = status_kib("VmRSS"), status_kib("VmHWM")
    reset = reset_peak()
    rng = np.random.default_rng(0)
    vocab = min(spec["shape"]["vocab"], 4096)
    prompt = {b: rng.integers(3, vocab, (b, spec["prompt"])) for b in (1, 8)}
    long = rng.integers(3, vocab, (1, spec["prefill"]))
    n = spec.get("onnx_tokens") or spec["new_tokens"]
    greedy_generate(session, prompt[1], max_new_tokens=2)  # warm-up
    times: dict[str, list[float]] = {"generate_b1": [], "generate_b8": [], "prefill": []}
    tokens = []
    for _ in range(spec["repeats"]):
        for batch in (1, 8):
            started = time.perf_counter()
            out = greedy_generate(session, prompt[batch], max_new_tokens=n)
            times[f"generate_b{batch}"].append(time.perf_counter() - started)
            tokens.append(out) if batch == 1 else None
        started = time.perf_counter()
        greedy_generate(session, long, max_new_tokens=1)
        times["prefill"].append(time.perf_counter() - started)
    held = initializer_bytes(path)
    peak = status_kib("VmHWM")
    return {
        "times": times,
        "tokens_per_s_b1": [n / t for t in times["generate_b1"]],
        "tokens_per_s_b8": [8 * n / t for t in times["generate_b8"]],
        "weight_bytes": held["model"],
        "decoder_weight_bytes": held["decoder"],
        "load_s": load_s,
        "rss_base_mib": base / 1024,
        "rss_loaded_mib": loaded / 1024,
        "peak_rss_load_mib": load_peak / 1024,
        "peak_rss_inference_mib": peak / 1024 if reset else None,
        "peak_rss_mib": max(load_peak, peak) / 1024,
        "first_tokens": tokens[0][0, spec["prompt"] :].tolist()[:8],
        "modules": "onnxruntime " + ("LutMatMul (our kernel)" if spec["onnx_kernel"] else "standard ops"),
        "dkm_paths": [],
    }


KERNEL_ROW = "onnxruntime DKM 3-bit, our kernel (onnxruntime-extensions)"  # dkm_onnx.py's rows (their names)
DENSE_ROW = "onnxruntime dense fp32 export"
PREFILL_TARGET = 1.5  # issue 53: our kernel's prefill at most 1.5x the dense export's


def onnx_verdicts(size: str, cell: dict) -> list[str]:
    """dkm_onnx.py's target for one size: our kernel's prefill at most `PREFILL_TARGET` times the dense export's
    (the median of per-round ratios), with its batch-1 speed and peak memory against dense beside it; a row measured
    on a loaded machine is judged by none."""
    from harness.slices import no_verdict, usable

    rows = {name.split(" (LOADED")[0]: v for name, v in cell.get("summary", {}).items()}
    ours, dense = rows.get(KERNEL_ROW), rows.get(DENSE_ROW)
    where = f"[{size}, 1 onnxruntime thread]"
    if ours is None or dense is None:
        return [f"{where} {KERNEL_ROW}: no verdict (it or the dense export did not run)"]
    if not (usable(ours) and usable(dense)):
        return [f"{where} {no_verdict(KERNEL_ROW, ours if ours.get('loaded') else dense)}"]
    ratio = ours["prefill_x_dense"]
    judged = "holds" if ratio <= PREFILL_TARGET else "FAILS"
    return [
        f"{where} {KERNEL_ROW}: prefill {ratio:.2f}x the dense export's ({judged} <= {PREFILL_TARGET}); batch 1 "
        f"{ours['b1_x_dense']:.2f}x its tokens/s at {ours['peak_x_dense']:.2f}x its peak memory"
    ]
