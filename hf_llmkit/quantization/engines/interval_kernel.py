"""The interval engine on the CPU in one C kernel (`_interval_native.c`, built once per machine by
`hf_llmkit.native.CLibrary`): each clustering iteration is one pass over the weights, forward and backward, and
everything of the table's size (the per-interval constants, the centroid updates, their derivatives) is computed in
C in double precision, so a layer's DKM costs a few C calls instead of hundreds of small torch ops.

- Scalar weights in float32 or bfloat16 (float16 widened to float32), with or without block scales (the kernel
  clusters `w / s` and multiplies back; the scales are constants to autograd, as in the torch path): one pass per
  iteration over the weights, and nothing per weight saved for backward (the weight is a parameter; its intervals and
  shares are recomputed there).
- 16-bit weights without block scales, at least 65,536 of them per table: the iterations run over each table's
  distinct bit patterns (at most 65,536, counted once per forward), and the weights take part only in lookups:
  one pass counts them, one reads each weight's output, and backward sums the output gradient per pattern and
  gives each weight `g J_p + H_p` (the same function as per weight: every weight of a pattern has the same value).
- On the CPU, 16-bit products are computed in float32 (`x.float() @ W_c^T`, `W_c` rounded to the input's dtype
  first), as the table engine does: some CPUs' bfloat16 GEMM is many times slower than float32's.

Everything else (float64 weights, accelerators, a machine without a C compiler, `torch_ops()`) takes the torch
implementation in `interval.py`; `tests/quantization/test_interval_kernel.py` holds the two to each other and to
naive DKM in float64.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import torch

from hf_llmkit.native import I64, INT, CLibrary, P
from hf_llmkit.quantization._dkm import autocast_off

F32, BF16 = 0, 1  # the C source's SRC_* codes
PATTERNS = 1 << 16


def _declare(lib: ctypes.CDLL) -> None:
    point = [P, INT, P, I64, I64, I64, P, I64]  # src, kind, mult, rows, cols, groups, scales, block
    lib.dkm_group_std.argtypes = [*point, P, INT]
    lib.dkm_forward.argtypes = [*point, P, INT, P, P, INT, P, P, P, INT, INT]  # ... imp, k, ...
    lib.dkm_backward.argtypes = [*point, P, INT, P, INT, P, P, P, P, P, P, P, INT, INT]
    lib.dkm_pattern_counts.argtypes = [P, I64, I64, P, INT]
    lib.dkm_pattern_lookup.argtypes = [P, I64, I64, P, P, INT]
    lib.dkm_pattern_grad_sums.argtypes = [P, P, I64, I64, P, INT]
    lib.dkm_pattern_apply.argtypes = [P, P, I64, I64, P, P, P, P, INT, P, INT]
    lib.dkm_max_level.argtypes = [INT]
    lib.dkm_forward.restype = INT
    lib.dkm_level.restype = INT
    for fn in (lib.dkm_group_std, lib.dkm_backward, lib.dkm_pattern_counts, lib.dkm_pattern_lookup,
               lib.dkm_pattern_grad_sums, lib.dkm_pattern_apply, lib.dkm_max_level):  # fmt: skip
        fn.restype = None


# -fno-trapping-math: the clamps and the rounding in exp vectorize (no floating-point exception is ever read)
_KERNEL = CLibrary(
    (Path(__file__).parents[2] / "_avx2_level.c", Path(__file__).with_name("_interval_native.c")), "dkm_interval",
    "The DKM training CPU kernel", "the interval engine uses torch ops", _declare, flags=("-fno-trapping-math",),
)  # fmt: skip
LOOPS = ("portable", "avx2")  # the C source's levels
_STATE = {"enabled": True}


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; None (and one log line saying why) where it cannot be built."""
    return _KERNEL.library()


def unavailable_reason() -> str:
    """Why `library()` is None ('' when it loaded)."""
    return _KERNEL.unavailable_reason()


def loops() -> str:
    """The per-point loops this CPU takes ("avx2" or "portable")."""
    return LOOPS[library().dkm_level()]


def cap_loops(name: str) -> None:
    """Take at most the `name` loops from now on ("avx2" lets the CPU choose again): tests compare them."""
    library().dkm_max_level(LOOPS.index(name))


@contextlib.contextmanager
def torch_ops():
    """The interval engine on torch's ops for the duration (tests and benchmarks compare the two paths)."""
    before = _STATE["enabled"]
    _STATE["enabled"] = False
    try:
        yield
    finally:
        _STATE["enabled"] = before


def available(weight: torch.Tensor) -> bool:
    """Whether the kernel can cluster `weight` here: on the CPU, float32 or 16-bit, the kernel built and on."""
    return (
        _STATE["enabled"]
        and weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and library() is not None
    )


def serves(x: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this layer call (`x` on the CPU too, or None)."""
    return available(weight) and (x is None or x.device.type == "cpu")


def _by_pattern(weight: torch.Tensor, groups: int, scales, importance=None) -> bool:
    """16-bit weights without scales or importance and with at least 65,536 weights per table run over their bit
    patterns (weighted by importance, the weights of a pattern would count differently: they run per weight)."""
    plain = scales is None and importance is None
    return plain and weight.element_size() == 2 and weight.numel() // groups >= PATTERNS


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


class _Points:
    """What the C kernel iterates over: the weight itself (`kind`, `scales`), or a table of distinct patterns with
    their counts (`mult`), `[rows, cols]` in `groups` runs of rows."""

    def __init__(self, src, kind, rows, cols, groups, scales=None, mult=None):
        self.src, self.kind, self.rows, self.cols, self.groups = src, kind, rows, cols, groups
        self.scales, self.mult = scales, mult
        self.block = 0 if scales is None else cols // scales.shape[1]

    def args(self) -> list:
        return [self.src.data_ptr(), self.kind, _ptr(self.mult), self.rows, self.cols, self.groups,
                _ptr(self.scales), self.block]  # fmt: skip


def _weight_points(weight: torch.Tensor, groups: int, scales) -> _Points:
    w = weight.detach()
    if w.dtype == torch.float16:  # the C loads float32 and bfloat16
        w = w.float()
    w = w.contiguous()
    kind = BF16 if w.dtype == torch.bfloat16 else F32
    s = None if scales is None else scales.detach().float().contiguous()
    return _Points(w, kind, w.shape[0], w.shape[1], groups, s)


_PATTERN_VALUES: dict[torch.dtype, torch.Tensor] = {}


def _pattern_values(dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of each of the 65,536 bit patterns of a 16-bit dtype (computed once)."""
    if dtype not in _PATTERN_VALUES:
        bits = torch.arange(PATTERNS, dtype=torch.int32).to(torch.int16)
        _PATTERN_VALUES[dtype] = bits.view(dtype).float()
    return _PATTERN_VALUES[dtype]


class _Patterns:
    """The distinct bit patterns of each table of a 16-bit weight: their values and counts `[G, U]` (padded with
    zero counts), and where each sits among all 65,536 (`slot`, flat `g 65536 + pattern`, of the filled places
    `place` of the flat `[G * U]`)."""

    def __init__(self, weight: torch.Tensor, groups: int):
        self.bits = weight.detach().contiguous().view(torch.int16)
        n = weight.numel()
        counts = torch.empty(groups, PATTERNS, dtype=torch.int32)
        library().dkm_pattern_counts(self.bits.data_ptr(), n, groups, counts.data_ptr(), _threads())
        self.slot = counts.view(-1).nonzero().squeeze(1)  # [sum U], in group order
        group = self.slot // PATTERNS
        patterns = _pattern_values(weight.dtype)
        if groups == 1:
            width, self.place = self.slot.numel(), None
        else:
            per = torch.bincount(group, minlength=groups)
            width = int(per.max())
            self.place = group * width + torch.arange(group.numel()) - (torch.cumsum(per, 0) - per)[group]
        self.values = self._padded(patterns.index_select(0, self.slot - group * PATTERNS), groups, width)
        self.mult = self._padded(counts.view(-1).index_select(0, self.slot).double(), groups, width)
        self.n, self.groups = n, groups

    def _padded(self, filled: torch.Tensor, groups: int, width: int) -> torch.Tensor:
        """`[G, U]` from the values of the filled places (the rest zero: a point of count zero adds nothing)."""
        if self.place is None:
            return filled.view(1, -1)
        return filled.new_zeros(groups * width).index_copy_(0, self.place, filled).view(groups, width)

    def points(self) -> _Points:
        return _Points(self.values, F32, self.groups, self.values.shape[1], self.groups, mult=self.mult)

    def gather(self, table: torch.Tensor) -> torch.Tensor:
        """A `[G * 65536]` per-pattern table at the points, `[G, U]`."""
        return self._padded(table.index_select(0, self.slot), self.groups, self.values.shape[1])

    def spread(self, per_point: torch.Tensor) -> torch.Tensor:
        """A `[G, U]` per-point float32 table as `[G * 65536]` (patterns absent from a table: 0)."""
        filled = per_point.view(-1) if self.place is None else per_point.view(-1)[self.place]
        return torch.zeros(self.groups * PATTERNS).index_copy_(0, self.slot, filled)

    def lookup(self, table: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.n)
        library().dkm_pattern_lookup(self.bits.data_ptr(), self.n, self.groups, table.data_ptr(), out.data_ptr(),
                                     _threads())  # fmt: skip
        return out


def _forward(points: _Points, centroids, cfg, round_bf16: bool, importance=None):
    """(the output `[rows, cols]` float32, std-scaled tau, trajectory `[T + 1, G, K]`, sums `[T, G, K + 1, 4]`);
    `importance` `[cols]` float32 weighs the k-means steps (None: uniform)."""
    lib = library()
    groups, k = centroids.shape[0], centroids.shape[1]
    std = torch.empty(groups, dtype=torch.float64)
    lib.dkm_group_std(*points.args(), std.data_ptr(), _threads())
    std.clamp_(min=1e-12)
    tau, eps = cfg.temperature * std, cfg.epsilon * std
    iters = cfg.dkm_iters
    traj = torch.empty(iters + 1, groups, k, dtype=torch.float64)
    traj[0] = centroids[..., 0].double()
    sums = torch.empty(max(iters, 1), groups, k + 1, 4, dtype=torch.float64)
    out = torch.empty(points.rows, points.cols)
    done = lib.dkm_forward(*points.args(), _ptr(importance), k, tau.data_ptr(), eps.data_ptr(), iters, traj.data_ptr(),
                           sums.data_ptr(), out.data_ptr(), int(round_bf16), _threads())  # fmt: skip
    return out, tau, traj[: done + 1].clone(), sums[:done].clone()


def _backward(points: _Points, tau, traj, sums, g=None, gsum=None, grad_steps=None, out=None, round_bf16=False,
              importance=None):  # fmt: skip
    """d loss / d points `[rows, cols]` (float32): see `dkm_backward` in the C source."""
    grad = torch.empty(points.rows, points.cols)
    done = traj.shape[0] - 1
    library().dkm_backward(
        *points.args(), _ptr(importance), traj.shape[2], tau.data_ptr(), done, traj.data_ptr(), sums.data_ptr(),
        _ptr(g), _ptr(gsum), grad.data_ptr(), _ptr(grad_steps), _ptr(out), int(round_bf16), _threads(),
    )  # fmt: skip
    return grad


def _product(x: torch.Tensor, w_c: torch.Tensor) -> torch.Tensor:
    """`x @ W_c^T` in `x`'s dtype; 16-bit inputs multiply in float32 (`W_c` already rounded to their dtype)."""
    if x.dtype == torch.float32:
        return x @ w_c.t()
    return (x.float() @ w_c.t()).to(x.dtype)


def _rounded(w_c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 output as the values of `dtype` (float16: rounded here; bfloat16 and float32 come rounded)."""
    return w_c.to(dtype).float() if dtype == torch.float16 else w_c


class IntervalKernel(torch.autograd.Function):
    """`x @ W_c^T` (or `W_c` when `x` is None) of DKM's soft-clustered weight, by the C kernel; also the new
    centroids. Saves the layer input, the weight, the scales, the importance (`[cols]`, None: uniform) and the
    table-sized trajectory of the iterations."""

    @staticmethod
    def forward(ctx, x, weight, scales, centroids, cfg, groups, importance=None):
        out_dtype = x.dtype if x is not None else weight.dtype
        round_bf16 = out_dtype == torch.bfloat16
        ctx.patterns = ctx.table = None
        if importance is not None:
            importance = importance.detach().float().contiguous()
        if _by_pattern(weight, groups, scales, importance):
            pats = _Patterns(weight, groups)
            per_point, tau, traj, sums = _forward(pats.points(), centroids, cfg, round_bf16)
            table = pats.spread(per_point)
            w_c = pats.lookup(table).view(weight.shape)
            ctx.patterns, ctx.table = pats, table
        else:
            pats = None
            points = _weight_points(weight, groups, scales)
            w_c, tau, traj, sums = _forward(points, centroids, cfg, round_bf16, importance)
        w_c = _rounded(w_c, out_dtype)
        ctx.cfg, ctx.groups, ctx.out_dtype = cfg, groups, out_dtype
        ctx.save_for_backward(x, weight, scales, tau, traj, sums, importance)
        new_cents = traj[-1].float().unsqueeze(-1)
        ctx.mark_non_differentiable(new_cents)
        result = w_c.to(weight.dtype) if x is None else _product(x, w_c)
        return result, new_cents

    @staticmethod
    @autocast_off
    def backward(ctx, grad, _grad_cents):
        x, weight, scales, tau, traj, sums, importance = ctx.saved_tensors
        rows, cols = weight.shape
        grad = grad.float()  # once (16-bit products are computed in float32 on the CPU)
        if x is not None:
            g = grad.reshape(-1, rows).t() @ x.reshape(-1, cols).float()  # d loss / d W_c
        else:
            g = grad.contiguous()
        need_x = x is not None and ctx.needs_input_grad[0]
        w_c = None
        round_bf16 = ctx.out_dtype == torch.bfloat16
        if ctx.patterns is not None:
            pats = ctx.patterns
            gsum = torch.empty(ctx.groups * PATTERNS, dtype=torch.float64)
            library().dkm_pattern_grad_sums(pats.bits.data_ptr(), g.data_ptr(), pats.n, ctx.groups, gsum.data_ptr(),
                                            _threads())  # fmt: skip
            steps = torch.zeros(pats.values.shape)
            jac = _backward(pats.points(), tau, traj, sums, gsum=pats.gather(gsum), grad_steps=steps)
            to_bf16 = weight.dtype == torch.bfloat16
            grad_w = torch.empty(rows, cols, dtype=torch.bfloat16 if to_bf16 else torch.float32)
            w_c = torch.empty(rows, cols) if need_x else None
            jac, steps = pats.spread(jac), pats.spread(steps)  # held here: C reads them
            library().dkm_pattern_apply(
                pats.bits.data_ptr(), g.data_ptr(), pats.n, ctx.groups, jac.data_ptr(), steps.data_ptr(),
                ctx.table.data_ptr(), grad_w.data_ptr(), int(to_bf16), _ptr(w_c), _threads(),
            )  # fmt: skip
        else:
            points = _weight_points(weight, ctx.groups, scales)
            w_c = torch.empty(rows, cols) if need_x else None
            grad_w = _backward(points, tau, traj, sums, g=g, out=w_c, round_bf16=round_bf16, importance=importance)
        grad_x = None
        if need_x:
            w_c = _rounded(w_c, ctx.out_dtype)
            grad_x = (grad @ w_c).to(x.dtype)
        return grad_x, grad_w.to(weight.dtype), None, None, None, None, None


def run(x, weight, centroids, settings, scales=None, importance=None):
    """The engine interface (see `engines/__init__.py`) on the kernel, with block `scales` `[rows, cols / block]`
    folded in (None: none) and the k-means steps weighted by `importance` (`[cols]`: each weight counts its input's
    importance times its block scale squared; None: uniform): `(x @ W_c^T or W_c, refined centroids)`."""
    if weight.dim() != 2:
        raise ValueError(f"the interval kernel clusters [rows, cols] weights, got shape {tuple(weight.shape)}")
    if x is not None:
        x = x.contiguous()
    assert importance is None or importance.shape == (weight.shape[1],), "one importance per input column"
    return IntervalKernel.apply(x, weight, scales, centroids, settings.config, settings.groups, importance)
