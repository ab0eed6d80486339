"""torch internals hf_llmkit relies on (checked against torch 2.11.0, the lowest declared, and the newest).

- `torch._C._storage_Use_Count(storage._cdata)`: how many references hold a storage. `GradientBuffer`
  (hf_llmkit.parallel.moe.grad_buffers) reuses a gradient's memory only when nothing but itself holds it; without
  this function it never reuses (correct, only slower).
- `Tensor._base`: the tensor a view was made from. The activation offload (hf_llmkit.parallel.sequence.offload)
  keeps a weight's transposed view on the device instead of copying it to the host.
- `Tensor._version`: the in-place modification counter. DKM's hard-weight cache (hf_llmkit.quantization.layers)
  is keyed by it, so `load_state_dict` and other in-place writes invalidate the cache. A fused optimizer step
  (`AdamW(fused=True)`) leaves it unchanged: the cache also counts optimizer steps (a public step hook).
- `torch._dynamo.config.patch(recompile_limit=...)`: how many specialisations (dtype, bits, block scales...) dynamo
  compiles one function into before it gives up on it. The packed-inference kernel (hf_llmkit.quantization.lut_gemv)
  needs one per kind of layer a model holds, more than the default 8 across models in one process; without it the
  kernel falls back to decoding the weight (correct, only slower).
- `nn.Module._apply(fn, recurse)`: how `.to()`, `.half()`, `.cuda()` reach every parameter and buffer. DKM's layers
  (hf_llmkit.quantization.layers and .palettized) override it so their tables keep their dtype through a dtype cast
  (`.to(float16)` would round them and the saved checkpoint would no longer match its config), as
  `from_pretrained(dtype=...)` keeps them (`apply_keeping_dtypes`).
- `Module._buffers`: a module's own buffers by name. The packed DKM layers (hf_llmkit.quantization._lut_native) read
  their three tensors on every token of generation; `nn.Module.__getattr__`'s fallback chain costs a few
  microseconds per read, a measurable share of a small model's token time.
- `torch.ops.aten.sigmoid_backward(g, y)`: `g y (1 - y)` in one pass. DKM's interval engine
  (hf_llmkit.quantization.engines.interval) multiplies gradients by the sigmoid's slope with it; where it is gone the
  product is written out (same values, more passes).

Each has no public equivalent in torch 2.11-2.14; `tests/compat/test_torch.py` fails when one disappears or changes
meaning (`make test` runs it on the newest torch, `make test-lowest` on 2.11).
"""

from __future__ import annotations

import contextlib

import torch

CHECKED_AGAINST = "2.11.0"

__all__ = [
    "CHECKED_AGAINST",
    "apply_keeping_dtypes",
    "module_buffers",
    "recompile_limit",
    "sigmoid_slope",
    "storage_use_count",
    "version_counter",
    "view_base",
]


def apply_keeping_dtypes(module: torch.nn.Module, apply, names: tuple[str, ...]) -> torch.nn.Module:
    """`apply()` (the module's `super()._apply(fn, recurse)`), with its buffers `names` moved as `fn` moves them but
    kept in their dtype (taken again from the originals, so nothing is rounded on the way)."""
    originals = {name: module._buffers[name] for name in names if module._buffers.get(name) is not None}
    out = apply()
    for name, original in originals.items():
        moved = module._buffers[name]
        if moved is not None and moved.dtype != original.dtype:
            module._buffers[name] = original.to(moved.device)
    return out


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
_SIGMOID_BACKWARD = getattr(torch.ops.aten, "sigmoid_backward", None)


def storage_use_count(storage: torch.UntypedStorage) -> int | None:
    """References to `storage` (tensors and storage objects), or None where this torch cannot tell."""
    if _STORAGE_USE_COUNT is None:
        return None
    return _STORAGE_USE_COUNT(storage._cdata)


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor `tensor` is a view of, or None when it owns its memory."""
    return tensor._base


def module_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """The live dict of `module`'s own buffers (None for one registered as None), read without `__getattr__`."""
    return module._buffers


def version_counter(tensor: torch.Tensor) -> int:
    """A counter that grows with every in-place change of `tensor` (and of tensors sharing its version counter)."""
    return tensor._version


def recompile_limit(limit: int) -> contextlib.AbstractContextManager:
    """A context in which dynamo compiles one function into up to `limit` specialisations (a no-op context where
    this torch has no such setting)."""
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    if config is None or not hasattr(config, "recompile_limit"):
        return contextlib.nullcontext()
    return config.patch(recompile_limit=limit)


def sigmoid_slope(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`grad * y * (1 - y)` (the sigmoid's derivative at output `y`, times `grad`), a new tensor."""
    if _SIGMOID_BACKWARD is None:
        return (y - y.square()).mul_(grad)
    return _SIGMOID_BACKWARD(grad, y)
