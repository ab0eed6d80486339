"""llama.cpp's formats of the same weights, a peer of dkm_quality.py's real-model section (issues 43, 51).

`llama-cpp-python` (`pip install llama-cpp-python==0.3.36`: pip builds llama.cpp from source, minutes on two cores,
and caches the wheel) quantizes the shipped Q4_1 GGUF of SmolLM2 with `llama_model_quantize` (`allow_requantize`: it
dequantizes the Q4_1 weights, the very weights our float32 folder holds, and quantizes them again) to each format of
`FORMATS` that applies to this model: the 32-weight block formats (Q4_0, IQ4_NL, Q5_0) and the K-quant mixes (Q2_K,
Q3_K_S/M/L, Q4_K_S/M), each with llama.cpp's own per-tensor mix of its type. K-quants pack 256 weights a super-block:
a matrix whose rows are not a multiple of 256 wide (SmolLM2's 576-wide q/k/v/o/gate/up) takes llama.cpp's fallback
type instead, so the bits per weight are counted from the written file's tensor types (`stored_bits`), never from the
format's name, and a format whose file holds the very tensors of an earlier one is that row again (`same_file_as`).

The embedding's treatment: the measured file keeps the token embedding (= the tied LM head) in float32, as every
other row of the table keeps it; llama.cpp's own default file of the format (its embedding at llama.cpp's type,
Q8_0 here) is written too, for its size (`default_file_mb`, `default_embedding`). The shipped Q4_1 file is measured as
shipped (its embedding Q8_0), a reference: its engine's own distance to our float32 reading of it. The model runs in
llama.cpp (`logits_all=True`) on the held-out token ids themselves, so the same metrics apply; `tokenizer_check`
records whether llama.cpp's own tokenizer gives those ids for the held-out text.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import time
from collections import Counter
from pathlib import Path

import numpy as np

INSTALL = "pip install llama-cpp-python==0.3.36 (pip builds llama.cpp from source and caches the wheel)"
# format -> the width whose slice (`--bits`) measures it; every format applies to a 576-wide model (K-quants with
# their fallback); the IQ2/IQ3 formats need an importance matrix and IQ4_XS / Q5_K+ are beyond the widths compared
FORMATS = {"Q2_K": 2, "Q3_K_S": 3, "Q3_K_M": 3, "Q3_K_L": 3, "Q4_0": 4, "IQ4_NL": 4, "Q4_K_S": 4, "Q4_K_M": 4,
           "Q5_0": 4}  # fmt: skip
SOURCE = "llama.cpp Q4_1, the shipped source file as shipped (its engine against our float32 reading)"
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def name_of(fmt: str) -> str:
    return f"llama.cpp {fmt} (its own mix; token embedding F32, as every row keeps it)"


def plan(widths) -> list[tuple[str, str | None, int]]:
    """(row name, format or None for the shipped file, width) of the llama.cpp rows of `widths`, in their order."""
    out = [(name_of(fmt), fmt, width) for fmt, width in FORMATS.items() if width in widths]
    if 4 in widths:
        out.insert(0, (SOURCE, None, 4))
    return out


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


def quantize(fmt: str, out: Path, threads: int, *, embedding_f32: bool = True) -> Path:
    """The source GGUF requantized to `fmt` with llama.cpp's own mix; the token embedding float32 (`embedding_f32`)
    or llama.cpp's choice."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{fmt}")
    params.allow_requantize = True
    if embedding_f32:
        params.token_embedding_type = llama_cpp.GGML_TYPE_F32
        params.output_tensor_type = llama_cpp.GGML_TYPE_F32
    params.nthread = threads
    code = llama_cpp.llama_model_quantize(str(source_gguf()).encode(), str(out).encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama_model_quantize returned {code}")
    return out


def stored(path: Path) -> dict:
    """What the file stores: bits per weight over the decoder's Linear matrices (`bpw`), {type: matrices} (`types`),
    the token embedding's type, every tensor's megabytes (`weights_mb`) and a digest of the decoder's data."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    decoder = [t for t in reader.tensors if t.name.startswith("blk.") and t.name.split(".")[2] in LINEARS]
    digest = hashlib.sha256()
    for t in decoder:
        digest.update(f"{t.name}:{t.tensor_type.name}".encode())
        digest.update(np.ascontiguousarray(t.data).view(np.uint8).tobytes())
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return {
        "bpw": sum(int(t.n_bytes) * 8 for t in decoder) / sum(int(t.n_elements) for t in decoder),
        "types": dict(Counter(t.tensor_type.name for t in decoder)),
        "embedding": embedding.tensor_type.name,
        "weights_mb": sum(int(t.n_bytes) for t in reader.tensors) / 1e6,
        "digest": digest.hexdigest()[:16],
    }


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


def measure(workload, fmt: str | None, width: int, threads: int, work: Path, earlier: dict[str, dict]) -> dict:
    """The row of `fmt` (None: the shipped file): its file's bits, types, embedding and sizes, and the metrics of
    llama.cpp running it; a file holding the very decoder tensors of a row in `earlier` ({digest: row}) takes that
    row's metrics (`same_file_as`). Raises where llama.cpp is missing or fails (the caller records the error)."""
    missing = available()
    if missing:
        raise RuntimeError(missing)
    row = {"bits": width, "trained": False, "steps": 0, "reference": fmt is None}
    start, cpu = time.perf_counter(), time.process_time()
    path = source_gguf() if fmt is None else quantize(fmt, work / f"{fmt}.gguf", threads)
    row["seconds"], row["cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
    row.update(stored(path))
    if fmt is not None:
        default = stored(quantize(fmt, work / f"{fmt}-default.gguf", threads, embedding_f32=False))
        row["default_file_mb"], row["default_embedding"] = default["weights_mb"], default["embedding"]
    same = earlier.get(row["digest"])
    if same is not None:
        row["same_file_as"] = same["method"]
        return {**row, **{m: same[m] for m in workload.metrics}}
    return {**row, **workload.metrics_of(block_logits(path, workload.eval_ids, threads))}
