"""SwiGLU's elementwise work for the experts on the CPU: `_swiglu_native.c` (built once per machine,
`hf_llmkit.native.CLibrary`), one pass over memory each way instead of torch's two ops forward and three backward,
and a tile keeps only its input rows and `h = [gate | up]` for backward (torch's ops also keep `silu(gate)` and
`silu(gate) * up`: at I = 4H, 9H floats per row instead of 17H).

It serves float32 CPU tensors; everything else (bfloat16 under autocast, GPUs, other activations, a machine without
a C compiler) takes the torch ops in `experts.py`. `benchmarks/moe.py` times the layer without it (its
`TORCH_OPS` row).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from hf_llmkit.native import I64, INT, CLibrary, P


def _declare(lib: ctypes.CDLL) -> None:
    lib.swiglu_forward.argtypes = [P, I64, I64, I64, P, INT]
    lib.swiglu_backward.argtypes = [P, P, I64, I64, I64, P, P, INT]
    lib.swiglu_max_level.argtypes = [INT]
    for fn in (lib.swiglu_forward, lib.swiglu_backward, lib.swiglu_max_level):
        fn.restype = None


# -fno-trapping-math: the clamps and the rounding in exp vectorize (no floating-point exception is ever read)
_KERNEL = CLibrary(
    (Path(__file__).parents[2] / "_avx2_level.c", Path(__file__).with_name("_swiglu_native.c")), "swiglu",
    "The MoE experts' CPU kernel", "experts use torch ops", _declare, flags=("-fno-trapping-math",),
)  # fmt: skip
LOOPS = ("portable", "avx2")  # the C source's levels


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; None (and one log line saying why) where it cannot be built."""
    return _KERNEL.library()


def serves(h: torch.Tensor) -> bool:
    """Whether the kernel takes this tile's pre-activations `h [rows, 2I]`: float32, on the CPU, contiguous."""
    return h.device.type == "cpu" and h.dtype == torch.float32 and h.is_contiguous() and library() is not None


def loops() -> str:
    """The loops this CPU takes ("avx2" or "portable")."""
    return LOOPS[library().swiglu_level()]


def cap_loops(name: str) -> None:
    """Take at most the `name` loops from now on ("avx2" lets the CPU choose again): tests compare them."""
    library().swiglu_max_level(LOOPS.index(name))


def forward(h: torch.Tensor) -> torch.Tensor:
    """`hidden = silu(gate) * up` `[rows, I]` from `h = [gate | up]` `[rows, 2I]` (nothing else is kept: backward
    recomputes what it needs from `h`)."""
    rows, inter = h.shape[0], h.shape[1] // 2
    hidden = h.new_empty(rows, inter)
    library().swiglu_forward(h.data_ptr(), rows, inter, h.shape[1], hidden.data_ptr(), torch.get_num_threads())
    return hidden


def backward(h: torch.Tensor, da: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[d gate | d up]` `[rows, 2I]` from `h = [gate | up]` and the gradient `da [rows, I]` of `silu(gate) * up`,
    and `silu(gate) * up` again (for the down projection's weight gradient)."""
    da = da.contiguous()
    rows, inter = h.shape[0], h.shape[1] // 2
    if da.dtype != torch.float32 or da.shape != (rows, inter):
        raise ValueError(f"da must be float32 [{rows}, {inter}], got {da.dtype} {list(da.shape)}")
    dh, hidden = torch.empty_like(h), h.new_empty(rows, inter)
    library().swiglu_backward(
        h.data_ptr(), da.data_ptr(), rows, inter, h.shape[1], dh.data_ptr(), hidden.data_ptr(), torch.get_num_threads()
    )
    return dh, hidden
