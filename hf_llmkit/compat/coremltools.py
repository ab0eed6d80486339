"""coremltools internals hf_llmkit relies on (checked against coremltools 9.0).

- The torch frontend's converters of `aten::Int` / `aten::Bool` (`frontend/torch/ops.py` `_cast`) call `int(x.val)`
  on a one-element array, which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python
  scalars"); every traced `view(*x.shape)` of a transformers model holds such casts. `fix_scalar_casts()` registers
  the same converters with the value taken by `.item()`, through the frontend's public `register_torch_op(...,
  override=True)`; it reads the node's inputs with the frontend's `_get_inputs`.
- `converters.mil.frontend.milproto.load.load`: a saved `.mlpackage`'s program back as a MIL `Program` (what
  `coremltools.optimize.coreml` itself does to edit a saved model), so tests read the weights an export wrote.

`tests/compat/test_coremltools.py` fails when one disappears or changes meaning.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHECKED_AGAINST = "9.0"

__all__ = ["CHECKED_AGAINST", "fix_scalar_casts", "load_program"]

_FIXED = False


def fix_scalar_casts() -> None:
    """Register numpy-2.4-safe converters of `aten::Int` / `aten::Bool` with coremltools' torch frontend (once)."""
    global _FIXED
    if _FIXED:
        return
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs
    from coremltools.converters.mil.frontend.torch.torch_op_registry import register_torch_op

    def cast(context, node, dtype, dtype_name: str) -> None:
        x = _get_inputs(context, node, expected=1)[0]
        if not (len(x.shape) == 0 or all(d == 1 for d in x.shape)):
            raise ValueError("input to cast must be either a scalar or a length 1 tensor")
        if x.can_be_folded_to_const():
            value = x.val
            res = x if isinstance(value, dtype) else mb.const(val=dtype(np.asarray(value).item()), name=node.name)
        else:
            if len(x.shape) > 0:
                x = mb.squeeze(x=x, name=node.name + "_item")
            res = mb.cast(x=x, dtype=dtype_name, name=node.name)
        context.add(res, node.name)

    def _int(context, node):
        cast(context, node, int, "int32")

    def _bool(context, node):
        cast(context, node, bool, "bool")

    register_torch_op(_int, torch_alias=["int"], override=True)
    register_torch_op(_bool, torch_alias=["bool"], override=True)
    _FIXED = True


def load_program(path: str | Path):
    """The MIL `Program` of a saved `.mlpackage` (its weights read from the package's weight file)."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load

    model = ct.models.MLModel(str(path), skip_model_load=True)
    return load(
        model.get_spec(),
        specification_version=model.get_spec().specificationVersion,
        file_weights_dir=model.weights_dir,
    )
