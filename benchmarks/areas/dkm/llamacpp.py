"""llama.cpp's K-quants of the same weights, a peer of dkm_quality.py's real-model section (issue 43).

`llama-cpp-python` (`pip install llama-cpp-python==0.3.36`: pip builds llama.cpp from source, minutes on two cores,
and caches the wheel) quantizes the shipped Q4_1 GGUF of SmolLM2 with `llama_model_quantize` (`allow_requantize`: it
dequantizes the Q4_1 weights, the very weights our float32 folder holds, and quantizes them again), `pure` (every
decoder matrix the asked type, no per-tensor mix), the token embedding (= the tied LM head) kept in float32 as every
other method keeps it. K-quants pack 256 weights a super-block: a matrix whose rows are not a multiple of 256 wide
(SmolLM2's 576-wide q/k/v/o/gate/up) takes llama.cpp's fallback type instead, which the row's type count and bits
per weight (read from the written file) show. The model then runs in llama.cpp (`logits_all=True`) on the held-out
token ids themselves, so the same metrics apply; `tokenizer_check` records whether llama.cpp's own tokenizer gives
those ids for the held-out text.
"""

from __future__ import annotations

import ctypes
import importlib.util
import time
from collections import Counter
from pathlib import Path

import numpy as np

INSTALL = "pip install llama-cpp-python==0.3.36 (pip builds llama.cpp from source and caches the wheel)"
FTYPES = {2: "LLAMA_FTYPE_MOSTLY_Q2_K", 3: "LLAMA_FTYPE_MOSTLY_Q3_K_S", 4: "LLAMA_FTYPE_MOSTLY_Q4_K_S"}
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def available() -> str | None:
    """None when llama-cpp-python and gguf import, else the reason (a row's error)."""
    for name in ("llama_cpp", "gguf"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed: {INSTALL if name == 'llama_cpp' else 'pip install gguf'}"
    return None


def source_gguf() -> Path:
    from hf_llmkit.testing import SMOLLM2_GGUF, SMOLLM2_PACKAGE

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def quantize(bits: int, out: Path, threads: int) -> Path:
    """The source GGUF requantized to the pure K-quant of `bits` (embedding and output in float32)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[bits])
    params.allow_requantize = True
    params.pure = True
    params.token_embedding_type = llama_cpp.GGML_TYPE_F32
    params.output_tensor_type = llama_cpp.GGML_TYPE_F32
    params.nthread = threads
    code = llama_cpp.llama_model_quantize(str(source_gguf()).encode(), str(out).encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama_model_quantize returned {code}")
    return out


def stored_bits(path: Path) -> tuple[float, dict[str, int]]:
    """(bits per weight over the decoder's Linear matrices as the file stores them, {type: matrices})."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    decoder = [t for t in reader.tensors if t.name.startswith("blk.") and t.name.split(".")[2] in LINEARS]
    bits = sum(int(t.n_bytes) * 8 for t in decoder) / sum(int(t.n_elements) for t in decoder)
    return bits, dict(Counter(t.tensor_type.name for t in decoder))


def block_logits(path: Path, eval_ids, threads: int):
    """llama.cpp's next-token logits `[block - 1, vocab]` (float32) of each held-out block, each on its own."""
    import llama_cpp

    block = eval_ids.shape[1]
    llm = llama_cpp.Llama(str(path), n_ctx=block, n_batch=block, n_threads=threads, logits_all=True, verbose=False)
    try:
        for ids in eval_ids.tolist():
            llm.reset()
            llm.eval(ids)
            yield np.array(llm.scores[: block - 1], dtype=np.float32)
    finally:
        llm.close()


def tokenizer_check(text: str, eval_ids) -> dict:
    """Whether llama.cpp's tokenizer (from the GGUF) gives the held-out ids transformers' tokenizer gave."""
    import llama_cpp

    llm = llama_cpp.Llama(str(source_gguf()), vocab_only=True, verbose=False)
    try:
        theirs = llm.tokenize(text.encode(), add_bos=False, special=False)
    finally:
        llm.close()
    ours = eval_ids.reshape(-1).tolist()
    same = sum(a == b for a, b in zip(ours, theirs))
    return {"tokens": len(ours), "equal_ids": same, "identical": theirs[: len(ours)] == ours}


def rows(workload, bits_list, threads: int, work: Path, source: bool = True):
    """llama.cpp's pure K-quant at each of `bits_list` and (`source`) the source Q4_1 file itself (its engine's own
    distance to the float32 source): a row of the table each, yielded as measured (or saying why it did not run)."""
    missing = available()
    plan = [(f"llama.cpp Q{b}_K (pure; 576-wide rows take its fallback)", b) for b in bits_list]
    if source:
        plan.append(("llama.cpp, the source Q4_1 file (its engine against our float32 reading)", None))
    for name, bits in plan:
        row = {"method": name, "bits": bits or 4, "trained": False, "steps": 0, "reference": bits is None}
        if missing:
            yield {**row, "error": missing}
            continue
        start, cpu = time.perf_counter(), time.process_time()
        try:
            path = source_gguf() if bits is None else quantize(bits, work / f"q{bits}k.gguf", threads)
            row["seconds"], row["cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
            row["bpw"], row["types"] = stored_bits(path)
            row.update(workload.metrics_of(block_logits(path, workload.eval_ids, threads)))
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported with its reason
            row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        yield row
