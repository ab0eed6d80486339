"""The CPU kernel of the packed DKM layers: `_lut_native.c` (portable loops, dispatch), `_lut_avx2.c` and
`_lut_avx512.c` (the x86-64 loops), `_lut_neon.c` (the AArch64 loop), built as one library once per machine with the
C compiler and loaded through ctypes (`hf_llmkit.native.CLibrary`: where it cannot be built, `library()` is None, the
reason is logged once, and `lut_gemv` takes its torch paths; `HF_LLMKIT_DKM_KERNEL=native` makes that an error).
Inside, the CPU picks the loops at run time: AVX512-BF16 (bfloat16 inputs and weights up to 4 bits), AVX-512 (VBMI,
up to 4 bits), AVX2 (with FMA and F16C: every table size, 5-8 bits by gathers), NEON (AArch64, up to 4 bits: the
portable loop's sums bit for bit, `tests/quantization/test_lut_neon.py` under qemu), or portable C (any CPU).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from hf_llmkit.compat.torch import module_buffers, version_counter
from hf_llmkit.native import I64, INT, CLibrary, P

SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("_lut_native.c", "_lut_avx2.c", "_lut_avx512.c", "_lut_neon.c")
)
# No fused multiply-add where the source writes a multiply and an add (compilers fuse them by default where the CPU
# has FMA: every AArch64 one): the portable loop then gives the same bits on every CPU, and NEON the portable's.
FLAGS = ("-ffp-contract=off",)
# the C source's SCALE_* codes, for tables and scales alike
_DTYPE_CODES = {None: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_OUT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DECODE_DTYPES = tuple(_OUT_CODES)


class WeightArgs(ctypes.Structure):
    """The C `weight_args` of one layer: pointers into its own tensors (nothing copied) and its shape."""

    _fields_ = [
        ("packed", P),
        ("rows", I64),
        ("cols", I64),
        ("bits", I64),
        ("lut", P),
        ("lut_dtype", I64),
        ("rows_per_group", I64),
        ("scale", P),
        ("scale_dtype", I64),
        ("nblocks", I64),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    weight = ctypes.POINTER(WeightArgs)
    lib.lut_gemv.argtypes = [weight, INT, P, INT, I64, P, INT, INT]
    lib.lut_gemv.restype = INT
    lib.lut_decode.argtypes = [weight, INT, P, INT]
    lib.lut_decode_rows.argtypes = [weight, INT, P, I64, P]
    lib.lut_level.argtypes = [INT, INT, INT, INT]
    lib.lut_max_level.argtypes = [INT]
    lib.lut_has_level.argtypes = [INT]
    lib.lut_has_level.restype = INT
    for fn in (lib.lut_decode, lib.lut_decode_rows, lib.lut_max_level):
        fn.restype = None


_KERNEL = CLibrary(SOURCES, "lut", "The DKM CPU kernel", "packed layers use torch paths", _declare, FLAGS)


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; None (and one log line saying why) where it cannot be built."""
    return _KERNEL.library()


def library_path() -> Path:
    """Where this machine's build of the kernel lives (it carries the source's hash)."""
    return _KERNEL.path()


def unavailable_reason() -> str:
    """Why `library()` is None ('' when it loaded)."""
    return _KERNEL.unavailable_reason()


LOOPS = ("portable", "avx2", "avx512", "avx512_bf16", "neon")  # the C source's LEVEL_* order


def loops(
    bits: int, block: int = 0, bf16_inputs: bool = False, table_dtype: torch.dtype = torch.float32
) -> str | None:
    """The loops a `bits`-bit weight with scale blocks of `block` columns (0: none) and tables saved as `table_dtype`
    takes on this CPU: `avx512_bf16` (bfloat16 inputs of a bfloat16 model, up to 4 bits, a CPU with AVX512-BF16),
    `avx512` (x86-64 with VBMI, up to 4 bits, and 8 bits with 16-bit tables), `avx2` (with FMA and F16C), `neon`
    (AArch64, up to 4 bits), `portable` (any other case); None where the kernel did not build. Inputs of every dtype
    take the float32 loops (widened once per call) where the bfloat16 ones do not serve."""
    lib = library()
    code = _DTYPE_CODES[torch.bfloat16 if bf16_inputs else torch.float32]
    return None if lib is None else LOOPS[lib.lut_level(bits, block, code, _DTYPE_CODES[table_dtype])]


def available_loops() -> tuple[str, ...]:
    """The loops this CPU can take, best first, down to `portable` (what tests and benchmarks force in turn); empty
    where the kernel did not build."""
    lib = library()
    return () if lib is None else tuple(name for i, name in reversed(list(enumerate(LOOPS))) if lib.lut_has_level(i))


def cap_loops(name: str) -> None:
    """Take at most the `name` loops from now on, in `LOOPS` order (`LOOPS[-1]` lets the CPU choose again; the x86-64
    levels sit below `neon`, so an AArch64 CPU capped at any of them takes `portable`): tests and benchmarks measure
    each level a CPU has this way. A ValueError names the levels for any other name."""
    if name not in LOOPS:
        raise ValueError(f"cap_loops({name!r}): use one of {', '.join(LOOPS)}")
    lib = library()
    if lib is None:
        raise ValueError(f"cap_loops({name!r}): the DKM CPU kernel did not build ({unavailable_reason()})")
    lib.lut_max_level(LOOPS.index(name))


def supports(layer, x: torch.Tensor | None = None) -> bool:
    """Whether the kernel serves `layer` (and `x`): CPU tensors, one index per weight, rows of whole bytes."""
    return (x is None or x.device.type == "cpu") and entry(layer) is not None


def _tensors(layer) -> tuple:
    """A packed layer's (indices, table, scales or None): a module's own buffers, read without `nn.Module.__getattr__`
    (every token reads them), or the attributes of any object that holds them (the ONNX runtime's kernels)."""
    if isinstance(layer, torch.nn.Module):
        buffers = module_buffers(layer)
        return buffers["weight_packed"], buffers["weight_lut"], buffers["weight_scale"]
    return layer.weight_packed, layer.weight_lut, layer.weight_scale


def serves(layer) -> bool:
    """Whether the kernel serves `layer`, read from its layout alone (no pointers: `torch.compile` traces this): built,
    CPU contiguous tensors, one index per weight, rows of whole bytes, table and scales in a dtype it reads."""
    packed, lut, scale = _tensors(layer)
    s = layer.settings
    rows, cols = layer.weight_shape
    tensors = (packed, lut) + (() if scale is None else (scale,))
    return (
        all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        and s.cluster_dim == 1
        and cols % 8 == 0
        and rows % s.groups == 0
        and lut.dtype in _DTYPE_CODES
        and (scale is None or scale.dtype in _DTYPE_CODES)
        and _KERNEL.built()
    )


def entry(layer) -> WeightArgs | None:
    """The C weight arguments of `layer` (None where the kernel does not serve it): pointers into its own tensors
    (nothing is copied), kept on the layer until one of them is replaced or changed in place."""
    packed, lut, scale = _tensors(layer)
    key = (packed.data_ptr(), version_counter(packed), lut.data_ptr(), version_counter(lut))
    if scale is not None:
        key += (scale.data_ptr(), version_counter(scale))
    cached = layer.__dict__.get("_native")
    if cached is not None and cached[0] == key:
        return cached[1]
    args = None
    if library() is not None and serves(layer):  # builds the kernel on first use
        s = layer.settings
        rows, cols = layer.weight_shape
        args = WeightArgs(packed.data_ptr(), rows, cols, s.bits, lut.data_ptr(), _DTYPE_CODES[lut.dtype])
        args.rows_per_group = rows // s.groups
        if scale is not None:
            args.scale, args.scale_dtype, args.nblocks = scale.data_ptr(), _DTYPE_CODES[scale.dtype], scale.shape[1]
    layer.__dict__["_native"] = (key, args)
    return args


def gemv(layer, x: torch.Tensor, mode: torch.dtype, out_dtype: torch.dtype = torch.float32, args=None):
    """`x @ W^T` `[*x.shape[:-1], rows]` of `x` `[..., cols]` in the compute dtype `mode`, each weight rounded to
    `mode` first (the dtype the decoded path multiplies in), summed in float32 and returned in `out_dtype` (rounded
    to nearest even, as `.to()` rounds), reading the weight once per 8 tokens (MAXM in C). bfloat16 inputs of a
    bfloat16 product take the AVX512-BF16 loops where they serve; the kernel widens every other input to float32
    once per call. `args`: the layer's `entry`, where the caller has it."""
    args = entry(layer) if args is None else args
    if x.dtype not in _DTYPE_CODES:
        x = x.float()
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty(*x.shape[:-1], layer.weight_shape[0], dtype=out_dtype)
    tokens = y.numel() // layer.weight_shape[0]
    threads = torch.get_num_threads()
    lib = library()
    if lib.lut_gemv(args, _OUT_CODES[mode], x.data_ptr(), _DTYPE_CODES[x.dtype], tokens, y.data_ptr(),
                    _OUT_CODES[out_dtype], threads):  # fmt: skip
        raise MemoryError(f"the DKM CPU kernel could not allocate its scratch for {tokens} tokens")
    return y


def decode(layer, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense weight `[rows, cols]` in `dtype` (float32, bfloat16 or float16), bit for bit `_dkm.decode`'s;
    written into `out` where given (contiguous, that shape and dtype: a buffer the caller reuses)."""
    if out is None:
        out = torch.empty(layer.weight_shape, dtype=dtype)
    elif out.shape != tuple(layer.weight_shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"decode: out must be a contiguous {dtype} tensor of shape {tuple(layer.weight_shape)}")
    library().lut_decode(entry(layer), _OUT_CODES[dtype], out.data_ptr(), torch.get_num_threads())
    return out


def decode_rows(layer, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (each in range: the caller checks) of the dense weight, `[*ids.shape, cols]` in `dtype`: an
    embedding's lookup, bit for bit the rows of `decode(layer, dtype)`."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(*ids.shape, layer.weight_shape[1], dtype=dtype)
    library().lut_decode_rows(entry(layer), _OUT_CODES[dtype], flat.data_ptr(), flat.numel(), out.data_ptr())
    return out


@torch.library.custom_op("hf_llmkit::lut_gemv", mutates_args=())
def gemv_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    lut: torch.Tensor,
    scale: torch.Tensor | None,
    rows: int,
    bits: int,
    groups: int,
    mode: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`gemv` as a torch operator, for graphs `torch.compile` captures (it calls the kernel as one opaque node):
    `x @ W^T` in `mode`, returned in `out_dtype`, of the weight held by `packed` / `lut` / `scale`, `rows` output
    features, `groups` tables."""
    cols = x.shape[-1]
    args = WeightArgs(packed.data_ptr(), rows, cols, bits, lut.data_ptr(), _DTYPE_CODES[lut.dtype], rows // groups)
    if scale is not None:
        args.scale, args.scale_dtype, args.nblocks = scale.data_ptr(), _DTYPE_CODES[scale.dtype], scale.shape[1]
    x = x.contiguous() if x.dtype in _DTYPE_CODES else x.float().contiguous()
    y = torch.empty(*x.shape[:-1], rows, dtype=out_dtype)
    tokens = y.numel() // rows
    if library().lut_gemv(args, _OUT_CODES[mode], x.data_ptr(), _DTYPE_CODES[x.dtype], tokens, y.data_ptr(),
                          _OUT_CODES[out_dtype], torch.get_num_threads()):  # fmt: skip
        raise MemoryError(f"the DKM CPU kernel could not allocate its scratch for {tokens} tokens")
    return y


@gemv_op.register_fake
def _(x, packed, lut, scale, rows, bits, groups, mode, out_dtype):
    return x.new_empty(*x.shape[:-1], rows, dtype=out_dtype)
