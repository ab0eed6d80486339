"""The CPU kernel of the packed DKM layers: `_lut_native.c`, built once per machine with the C compiler and loaded
through ctypes.

The C source is small and has no torch headers, so the build takes about a second (a torch C++ extension would take
minutes). The library lands in `<hf_llmkit cache>/kernels/` under a name that carries the source's hash and the
machine's architecture, is written to a private temporary and renamed into place, so concurrent processes never load
a half-written one. It needs `cc` (or `$CC`); where there is none, or the build fails, `library()` is None, the
reason is logged once, and `lut_gemv` takes its torch paths (`HF_LLMKIT_DKM_KERNEL=native` makes that an error).
Inside, the CPU picks the loops at run time: AVX512-BF16 (bfloat16 inputs), AVX-512 (with VBMI), AVX2 (with FMA),
or portable C (any CPU, and tables over 16 entries).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from hf_llmkit.data.cache import temporary_sibling

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_lut_native.c")
# read once: a process builds and loads what it read at import, whatever edits follow (empty: an install without it)
_TEXT = SOURCE.read_bytes() if SOURCE.is_file() else b""
# the C source's SCALE_* codes, for tables and scales alike
_DTYPE_CODES = {None: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_OUT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DECODE_DTYPES = tuple(_OUT_CODES)
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_state: dict[str, object] = {}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(target: Path) -> None:
    """Compile the source into `target` (with OpenMP where the compiler has it), atomically."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (install gcc, or set $CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(target)
    base = [cc, "-O3", "-std=gnu11", "-shared", "-fPIC", "-x", "c", "-", "-o", str(tmp)]
    errors = ""
    for extra in (["-fopenmp"], []):
        done = subprocess.run([*base[:2], *extra, *base[2:]], input=_TEXT, capture_output=True)
        if done.returncode == 0:
            os.replace(tmp, target)
            return
        errors = done.stderr.decode(errors="replace").strip()
    tmp.unlink(missing_ok=True)
    raise RuntimeError(f"{cc} failed: {errors.splitlines()[0] if errors else 'no message'}")


def library_path() -> Path:
    """Where this machine's build of the kernel lives (it carries the source's hash)."""
    from hf_llmkit.data.corpus import default_cache_dir  # here: `python -m hf_llmkit.data.corpus` runs it once

    digest = hashlib.sha256(_TEXT).hexdigest()[:16]
    return default_cache_dir() / "kernels" / f"lut-{digest}-{sys.platform}-{platform.machine()}.so"


def _load() -> ctypes.CDLL:
    path = library_path()
    if not path.is_file():
        _build(path)
    lib = ctypes.CDLL(str(path))
    common = [_P, _I64, _I64, _INT, _P, _INT, _I64, _P, _INT, _I64, _INT]
    lib.lut_gemv.argtypes = [*common, _P, _INT, _I64, _P, _INT]
    lib.lut_decode.argtypes = [*common, _P, _INT]
    lib.lut_level.argtypes = [_INT, _INT, _INT]
    lib.lut_max_level.argtypes = [_INT]
    for fn in (lib.lut_gemv, lib.lut_decode):
        fn.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; None (and one log line saying why) where it cannot be built."""
    if "lib" not in _state:
        try:
            if not _TEXT:
                raise RuntimeError(f"{SOURCE.name} is missing from this installation of hf_llmkit")
            if sys.byteorder != "little":
                raise RuntimeError("the index stream is read as little-endian words")
            _state["lib"] = _load()
        except Exception as error:  # noqa: BLE001 - no compiler, read-only cache, odd platform: torch paths serve
            _state["lib"], _state["error"] = None, str(error).strip().splitlines()[0] if str(error).strip() else ""
            logger.warning("The DKM CPU kernel is not available (%s); packed layers use torch paths", _state["error"])
    return _state["lib"]  # type: ignore[return-value]


def unavailable_reason() -> str:
    """Why `library()` is None ('' when it loaded)."""
    library()
    return str(_state.get("error", ""))


LOOPS = ("portable", "avx2", "avx512", "avx512_bf16")  # the C source's LEVEL_* order


def loops(bits: int, block: int = 0, bf16_inputs: bool = False) -> str | None:
    """The loops a `bits`-bit weight with scale blocks of `block` columns (0: none) takes on this CPU:
    `avx512_bf16` (bfloat16 inputs, a CPU with AVX512-BF16), `avx512` (x86-64 with VBMI), `avx2` (with FMA),
    `portable` (any CPU, and above 4 bits); None where the kernel did not build."""
    lib = library()
    return None if lib is None else LOOPS[lib.lut_level(bits, block, int(bf16_inputs))]


def cap_loops(name: str) -> None:
    """Take at most the `name` loops from now on (`avx512_bf16` lets the CPU choose again): tests compare them."""
    library().lut_max_level(LOOPS.index(name))


def supports(layer, x: torch.Tensor | None = None) -> bool:
    """Whether the kernel serves `layer` (and `x`): CPU tensors, one index per weight, rows of whole bytes."""
    return (x is None or x.device.type == "cpu") and _entry(layer) is not None


def _entry(layer) -> list | None:
    """The C weight arguments of `layer` (None where the kernel does not serve it): pointers into its own tensors
    (nothing is copied), kept on the layer until one of them is replaced or changed in place."""
    packed, lut, scale = layer.weight_packed, layer.weight_lut, layer.weight_scale
    key = (packed.data_ptr(), packed._version, lut.data_ptr(), lut._version)
    key += () if scale is None else (scale.data_ptr(), scale._version)
    cached = layer.__dict__.get("_native")
    if cached is not None and cached[0] == key:
        return cached[1]
    s = layer.settings
    rows, cols = layer.weight_shape
    tensors = (packed, lut) + (() if scale is None else (scale,))
    args = None
    if (
        all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        and s.cluster_dim == 1
        and cols % 8 == 0
        and rows % s.groups == 0
        and lut.dtype in _DTYPE_CODES
        and (scale is None or scale.dtype in _DTYPE_CODES)
        and library() is not None
    ):
        args = [packed.data_ptr(), rows, cols, s.bits, lut.data_ptr(), _DTYPE_CODES[lut.dtype], rows // s.groups]
        args += [None, 0, 0] if scale is None else [scale.data_ptr(), _DTYPE_CODES[scale.dtype], scale.shape[1]]
    layer.__dict__["_native"] = (key, args)
    return args


def gemv(layer, x: torch.Tensor, mode: torch.dtype) -> torch.Tensor:
    """Float32 `x @ W^T` `[m, rows]` of `x` `[m, cols]` in the compute dtype `mode`, each weight rounded to `mode`
    first (the dtype the decoded path multiplies in), reading the weight once per 8 tokens (MAXM in C). bfloat16
    inputs go to the AVX512-BF16 loops where they serve, every other input is widened to float32."""
    args = [*_entry(layer), _OUT_CODES[mode]]
    lib = _state["lib"]
    scale = layer.weight_scale
    block = 0 if scale is None else layer.weight_shape[1] // scale.shape[1]
    bf16 = x.dtype == mode == torch.bfloat16 and LOOPS[lib.lut_level(layer.settings.bits, block, 1)] == "avx512_bf16"
    x = x.contiguous() if bf16 else x.float().contiguous()
    y = torch.empty(x.shape[0], layer.weight_shape[0], dtype=torch.float32)
    lib.lut_gemv(*args, x.data_ptr(), int(bf16), x.shape[0], y.data_ptr(), torch.get_num_threads())
    return y


def decode(layer, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight `[rows, cols]` in `dtype` (float32, bfloat16 or float16), bit for bit `_dkm.decode`'s."""
    out = torch.empty(layer.weight_shape, dtype=dtype)
    _state["lib"].lut_decode(*_entry(layer), _OUT_CODES[dtype], out.data_ptr(), torch.get_num_threads())
    return out
