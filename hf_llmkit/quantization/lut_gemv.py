"""Packed inference of the palettized layers: multiply by a DKM weight straight from its saved n-bit indices.

A compact checkpoint's weight is `weight_packed` (the n-bit index stream of `_packing.pack_indices`), `weight_lut`
(`[G, K, d]`) and, with block scales, `weight_scale` (`[rows, cols / block]`). The layers keep exactly these tensors
in memory (3 or 4 bits per weight plus the small tables and scales) and never store a decoded weight. This module
is the one place that decides how they multiply:

- `"triton"`: CUDA tensors where triton imports: a hand-written LUT-GEMV kernel (`_lut_triton.py`, in the style of
  FLUTE) reads the index bits, looks them up in the table, scales them and reduces against `x`, in one pass.
- `"native"`: CPU tensors where the C kernel builds (`_lut_native.py`: one index per weight, rows of whole bytes):
  the same single pass in C, with AVX-512 loops where the CPU has VBMI; it also decodes weights for prefill.
- `"compile"`: `torch.compile` of `fused_lut_gemv`, the same computation as one torch definition (inductor generates
  C++ on CPU, Triton on GPU); used where it compiles, else `"eager"` (the failure is logged once).
- `"eager"`: the weight is decoded with a few whole-tensor ops (`decode_weight`) and `F.linear` multiplies.

The fused paths serve up to `MAX_FUSED_TOKENS` tokens (token-by-token decoding, where the product is bound by reading
the weight); longer inputs (prefill), inputs that need a gradient and `HF_LLMKIT_DKM_KERNEL=eager` decode the weight
once per forward (with the C kernel where it serves, else whole-tensor torch ops) and let the matmul library multiply.
`decodes(tokens, weights, blocked)` is that switch (`MAX_FUSED_TOKENS_LARGE` for weights of `LARGE_WEIGHTS` or more
decoded whole), for the ONNX export's kernels too (`export/onnx_runtime.py`, which decode in blocks);
`benchmarks/dkm_inference.py --parts loops` (`areas/inference/switch.py`) measures, per layer shape and compute dtype,
from how many tokens decoding and one GEMM beats the fused product, and says whether `MAX_FUSED_TOKENS` agrees.
`HF_LLMKIT_DKM_KERNEL` (`auto`, `eager`, `native`, `compile`, `triton`) forces a path; the path each device type takes
is logged once. All paths decode the same float32 weight as the hard assignment (`_dkm.decode`): the decoded paths give
the same logits bit for bit, the fused ones within float32 rounding of the reduction.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch
import torch.nn.functional as F

from hf_llmkit.compat.torch import recompile_limit
from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.quantization import _lut_native as native
from hf_llmkit.quantization._packing import unpack_indices

logger = logging.getLogger(__name__)

PATHS = ("auto", "eager", "native", "compile", "triton")
ENV = "HF_LLMKIT_DKM_KERNEL"
RECOMPILE_LIMIT = 64  # compiled specialisations of the kernel (dtype x bits x table kind x scales...) per process
# Above these token counts the weight is decoded once and the matmul library multiplies (prefill; `decodes`), from
# the quiet measurement of `benchmarks/dkm_inference.py --parts loops` (docs/dkm.md, the prefill switch): layer shapes
# cross over at 12-32 tokens; decoded whole (the PyTorch layers), a weight of LARGE_WEIGHTS or more (an LM head:
# SmolLM2's 49,152 x 576) costs more than the fused product spends up to about 64; decoded in blocks that stay in
# cache (the ONNX kernels) it crosses over where the others do.
MAX_FUSED_TOKENS = 16
MAX_FUSED_TOKENS_LARGE, LARGE_WEIGHTS = 64, 8 * 2**20

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # others (float64) decode
_logged: set[tuple[str, str]] = set()
_broken: set[str] = set()  # device types where torch.compile failed once
_compiled = None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a Linear computes `x @ W^T` in: autocast's lower precision where autocast is on for `x`'s device
    (as `F.linear` does under `torch.autocast`), else `x`'s own dtype."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def requested_path() -> str:
    """The path `HF_LLMKIT_DKM_KERNEL` asks for (`auto` when unset); a ValueError for any other value."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in PATHS:
        raise ValueError(f"{ENV}={value!r} is not a DKM inference path: use one of {', '.join(PATHS)}.")
    return value


def decodes(tokens: int, weights: int = 0, blocked: bool = False) -> bool:
    """Whether a product of `tokens` tokens by a weight of `weights` entries decodes the weight and lets the matmul
    library multiply (prefill) instead of taking a fused path (the C kernel reads the weight once per 8 tokens: MAXM
    in `_lut_native.c`); `blocked`: the decode goes a block of rows at a time (the ONNX kernels), not whole."""
    large = weights >= LARGE_WEIGHTS and not blocked
    return tokens > (MAX_FUSED_TOKENS_LARGE if large else MAX_FUSED_TOKENS)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose_path(device: torch.device, layer=None) -> str:
    """The fused path for `device` (and `layer`): `triton` (CUDA with triton), `native` (CPU, where the C kernel
    serves the layer), `compile`, or `eager` (forced, or compile failed)."""
    want = requested_path()
    if want == "auto":
        if device.type == "cuda" and triton_available():
            want = "triton"
        elif device.type == "cpu" and layer is not None and native.supports(layer):
            want = "native"
        else:
            want = "compile"
    elif want == "triton" and not triton_available():
        raise ValueError(f"{ENV}=triton but triton is not installed: pip install triton, or unset {ENV}.")
    elif want == "native":
        if device.type != "cpu" or native.library() is None:
            why = f"did not build ({native.unavailable_reason()})" if device.type == "cpu" else "runs on CPU only"
            raise ValueError(f"{ENV}=native but the C kernel {why}; or unset {ENV}.")  # the reason names its fix
        if layer is not None and not native.supports(layer):
            want = "compile"  # a layer the kernel does not serve (vector tables, odd widths)
    if want == "compile" and device.type in _broken:
        want = "eager"
    _log_once(device.type, want)
    return want


def _log_once(device_type: str, path: str, reason: str = "") -> None:
    if (device_type, path) not in _logged:
        _logged.add((device_type, path))
        log = logger.warning if reason else logger.info
        log("DKM packed layers on %s multiply with the %s path%s", device_type, path, reason)


def decode_weight(layer, dtype: torch.dtype) -> torch.Tensor:
    """The layer's dense weight in `dtype`: bit for bit the hard assignment's. The C kernel decodes where it serves
    the layer and `HF_LLMKIT_DKM_KERNEL` is not `eager`; elsewhere whole-tensor torch ops do."""
    compiling = torch.compiler.is_compiling()
    if dtype in native.DECODE_DTYPES and not compiling and requested_path() != "eager" and native.supports(layer):
        return native.decode(layer, dtype)
    s = layer.settings
    idx = unpack_indices(layer.weight_packed, s.bits, layer.count).reshape(s.groups, -1)
    return dkm.decode(layer.weight_lut, idx, layer.weight_shape, layer.weight_scale).to(dtype)


def decode_rows(layer, rows: torch.Tensor) -> torch.Tensor:
    """Float32 rows `[*rows.shape, cols]` of the layer's decoded weight (an embedding's lookup), read from the index
    bits of those rows only: bit for bit the rows of `decode_weight(layer, torch.float32)` (the C kernel reads them on
    CPU where it serves the layer and `HF_LLMKIT_DKM_KERNEL` is not `eager`)."""
    compiling = torch.compiler.is_compiling()
    if rows.device.type == "cpu" and not compiling and requested_path() != "eager" and native.supports(layer):
        return native.decode_rows(layer, rows, torch.float32)
    s = layer.settings
    cols = layer.weight_shape[1]
    flat = rows.to(torch.int64).unsqueeze(-1) * cols + torch.arange(cols, device=rows.device)  # [..., cols]
    table = layer.weight_lut.float()
    idx = _indices_at(layer.weight_packed, s.bits, flat // s.cluster_dim)
    group = rows.to(torch.int64).unsqueeze(-1) // (layer.weight_shape[0] // s.groups)
    w = table.reshape(-1)[(group * table.shape[1] + idx) * s.cluster_dim + flat % s.cluster_dim]
    if layer.weight_scale is None:
        return w
    block = cols // layer.weight_scale.shape[1]
    return w * layer.weight_scale.float().reshape(-1)[flat // block]


def _indices_at(packed: torch.Tensor, bits: int, n: torch.Tensor) -> torch.Tensor:
    """Indices number `n` (any shape, int64) of a packed stream: two bytes read per index, shifted and masked."""
    pos = n * bits
    byte = pos >> 3
    lo = packed[byte].to(torch.int32)
    hi = packed[(byte + 1).clamp_max(packed.numel() - 1)].to(torch.int32)
    return (((lo | (hi << 8)) >> (pos & 7).to(torch.int32)) & ((1 << bits) - 1)).to(torch.int64)


def fused_lut_gemv(
    x: torch.Tensor, packed: torch.Tensor, lut: torch.Tensor, scale: torch.Tensor | None, rows: int, bits: int
) -> torch.Tensor:
    """`x @ W^T` (float32 `[B, rows]`) of the palettized weight without decoding it to memory: `y_i = sum_b s_ib
    sum_j T[idx_ij] x_j` in one expression that `torch.compile` fuses into one reduction kernel.

    `x` `[B, cols]` in the compute dtype; `packed` the flat index stream; `lut` the float32 table `[G, K, d]`;
    `scale` float32 `[rows, cols / block]` or None. Each weight is rounded to `x`'s dtype before the product, as the
    decoded path rounds the weight it hands to `F.linear`.
    """
    cols = x.shape[-1]
    groups, k, d = lut.shape
    r = torch.arange(rows, device=x.device).unsqueeze(-1)  # [rows, 1]
    flat = r * cols + torch.arange(cols, device=x.device)  # [rows, cols]
    idx = _indices_at(packed, bits, flat // d)
    w = lut.reshape(-1)[((r // (rows // groups)) * k + idx) * d + flat % d]
    if scale is not None:
        w = w * scale.reshape(-1)[flat // (cols // scale.shape[1])]
    w = w.to(x.dtype).float()
    return (x.float().unsqueeze(1) * w).sum(-1)  # [B, rows]


def _compiled_gemv():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(fused_lut_gemv, dynamic=True, fullgraph=True)
    return _compiled


def linear(layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, W, bias)` of a `PalettizedLinear` weight `W`, in `compute_dtype(x)`, by the chosen path."""
    dtype = compute_dtype(x)
    if x.dtype != dtype:
        x = x.to(dtype)
    tokens = x.numel() // max(x.shape[-1], 1)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    if decodes(tokens, layer.weight_shape[0] * layer.weight_shape[1]) or needs_grad or dtype not in FUSED_DTYPES:
        return F.linear(x, decode_weight(layer, dtype), None if bias is None else bias.to(dtype))
    if x.device.type == "cpu" and requested_path() in ("auto", "native"):
        # the path `choose_path` takes where the C kernel serves the layer, decided with the fewest Python steps
        # (this runs for every Linear of every generated token)
        out = dtype if bias is None else torch.float32  # the kernel rounds its float32 sums as `.to(dtype)` would
        if torch.compiler.is_compiling():
            if native.serves(layer):  # the kernel as one operator of the captured graph
                s = layer.settings
                y = native.gemv_op(x, layer.weight_packed, layer.weight_lut, layer.weight_scale,
                                   layer.weight_shape[0], s.bits, s.groups, dtype, out)  # fmt: skip
                return y if bias is None else (y + bias.float()).to(dtype)
        else:
            args = native.entry(layer)
            if args is not None:
                _log_once("cpu", "native")
                y = native.gemv(layer, x, dtype, out, args)
                return y if bias is None else (y + bias.float()).to(dtype)
    path = choose_path(x.device, layer)
    if path == "eager":
        return F.linear(x, decode_weight(layer, dtype), None if bias is None else bias.to(dtype))
    scale = None if layer.weight_scale is None else layer.weight_scale.float()
    x2 = x.reshape(tokens, x.shape[-1])
    args = (x2, layer.weight_packed, layer.weight_lut.float(), scale, layer.weight_shape[0], layer.settings.bits)
    with torch.autocast(x.device.type, enabled=False):
        y = _fused(path, args)
    if y is None:
        return F.linear(x, decode_weight(layer, dtype), None if bias is None else bias.to(dtype))
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype).reshape(*x.shape[:-1], layer.weight_shape[0])


def _fused(path: str, args: tuple) -> torch.Tensor | None:
    """The fused product by `path`; None where torch.compile failed (the caller decodes; logged once)."""
    if path == "triton":
        from hf_llmkit.quantization._lut_triton import lut_gemv

        return lut_gemv(*args)
    if torch.compiler.is_compiling():  # inside the user's torch.compile: let it trace the definition itself
        return fused_lut_gemv(*args)
    device_type = args[0].device.type
    try:
        with recompile_limit(RECOMPILE_LIMIT):
            return _compiled_gemv()(*args)
    except Exception as error:  # noqa: BLE001 - no compiler, unsupported backend...: fall back, once, loudly
        _broken.add(device_type)
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        _log_once(device_type, "eager", f" (torch.compile failed: {first})")
        return None
