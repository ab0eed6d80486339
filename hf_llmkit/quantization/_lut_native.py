"""The CPU kernel of the packed DKM layers: `_lut_native.c`, built once per machine with the C compiler and loaded
through ctypes (`hf_llmkit.native.CLibrary`: where it cannot be built, `library()` is None, the reason is logged
once, and `lut_gemv` takes its torch paths; `HF_LLMKIT_DKM_KERNEL=native` makes that an error).
Inside, the CPU picks the loops at run time: AVX512-BF16 (bfloat16 inputs), AVX-512 (with VBMI), AVX2 (with FMA),
or portable C (any CPU, and tables over 16 entries).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from hf_llmkit.native import I64, INT, CLibrary, P

SOURCE = Path(__file__).with_name("_lut_native.c")
# the C source's SCALE_* codes, for tables and scales alike
_DTYPE_CODES = {None: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_OUT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DECODE_DTYPES = tuple(_OUT_CODES)


def _declare(lib: ctypes.CDLL) -> None:
    common = [P, I64, I64, INT, P, INT, I64, P, INT, I64, INT]
    lib.lut_gemv.argtypes = [*common, P, INT, I64, P, INT]
    lib.lut_decode.argtypes = [*common, P, INT]
    lib.lut_level.argtypes = [INT, INT, INT]
    lib.lut_max_level.argtypes = [INT]
    for fn in (lib.lut_gemv, lib.lut_decode):
        fn.restype = None


_KERNEL = CLibrary(SOURCE, "lut", "The DKM CPU kernel", "packed layers use torch paths", _declare)


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; None (and one log line saying why) where it cannot be built."""
    return _KERNEL.library()


def library_path() -> Path:
    """Where this machine's build of the kernel lives (it carries the source's hash)."""
    return _KERNEL.path()


def unavailable_reason() -> str:
    """Why `library()` is None ('' when it loaded)."""
    return _KERNEL.unavailable_reason()


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
    lib = library()
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
    library().lut_decode(*_entry(layer), _OUT_CODES[dtype], out.data_ptr(), torch.get_num_threads())
    return out
