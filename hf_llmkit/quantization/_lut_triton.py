"""Triton LUT-GEMV of a palettized weight (the GPU path of `lut_gemv`), in the style of FLUTE's LUT-quantized GEMM
with group scales: each program owns `BLOCK_R` output channels of one token and walks the input features in tiles,
reading every weight's index bits from the packed stream, looking the index up in its channel's table (`[G, K, d]`,
float32), multiplying by the block scale, rounding to `x`'s dtype (as the decoded path rounds its weight)
and reducing against `x` in float32. The weight is never written to memory.

Imported only where triton is installed; runs on CPU tensors under `TRITON_INTERPRET=1` (the tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 32
BLOCK_C = 128
ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # each weight is rounded to x's dtype


@triton.jit
def _lut_gemv_kernel(
    x_ptr,
    packed_ptr,
    lut_ptr,
    scale_ptr,
    y_ptr,
    rows,
    cols,
    nbytes,
    group_rows,
    n_blocks,
    block,
    BITS: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_r = tl.program_id(0)
    b = tl.program_id(1)  # token
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    group = r // group_rows
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, cols, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cmask = c < cols
        m = rmask[:, None] & cmask[None, :]
        flat = r[:, None].to(tl.int64) * cols + c[None, :]  # [BLOCK_R, BLOCK_C] weight number
        pos = (flat // D) * BITS  # first bit of the weight's index in the stream
        byte = pos >> 3
        lo = tl.load(packed_ptr + byte, mask=m, other=0).to(tl.int32)
        hi = tl.load(packed_ptr + byte + 1, mask=m & (byte + 1 < nbytes), other=0).to(tl.int32)
        idx = ((lo | (hi << 8)) >> (pos & 7).to(tl.int32)) & (K - 1)
        w = tl.load(lut_ptr + (group[:, None] * K + idx) * D + flat % D, mask=m, other=0.0)
        if HAS_SCALE:
            w = w * tl.load(scale_ptr + r[:, None] * n_blocks + c[None, :] // block, mask=m, other=0.0)
        xv = tl.load(x_ptr + b * cols + c, mask=cmask, other=0.0)
        if ROUND == 1:  # to bfloat16, nearest-even, by bits (the interpreter's cast truncates)
            u = w.to(tl.int32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
            w = u.to(tl.float32, bitcast=True)
        elif ROUND == 2:
            w = w.to(tl.float16).to(tl.float32)
        acc += tl.sum(w * xv.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + b * rows + r, acc, mask=rmask)


def lut_gemv(
    x: torch.Tensor, packed: torch.Tensor, lut: torch.Tensor, scale: torch.Tensor | None, rows: int, bits: int
) -> torch.Tensor:
    """`x @ W^T` (float32 `[B, rows]`) of a palettized weight; the arguments of `lut_gemv.fused_lut_gemv`."""
    tokens, cols = x.shape
    groups, k, d = lut.shape
    x, lut = x.contiguous(), lut.contiguous()
    scale = None if scale is None else scale.contiguous()
    y = torch.empty(tokens, rows, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, BLOCK_R), tokens)
    _lut_gemv_kernel[grid](
        x,
        packed,
        lut,
        lut if scale is None else scale,
        y,
        rows,
        cols,
        packed.numel(),
        rows // groups,
        0 if scale is None else scale.shape[1],
        1 if scale is None else cols // scale.shape[1],
        BITS=bits,
        K=k,
        D=d,
        HAS_SCALE=scale is not None,
        ROUND=ROUNDING[x.dtype],
        BLOCK_R=BLOCK_R,
        BLOCK_C=BLOCK_C,
    )
    return y
