"""onnxruntime-extensions internals hf_llmkit relies on (checked against onnxruntime-extensions 0.15.2).

onnxruntime-extensions runs a Python custom operator through one hook, `_ocos._on_pyop_invocation`, installed with
`PyCustomOpDef.install_hooker`: it calls the operator's function and returns each output as `(shape,
flatten().tolist())`, a Python float per element, which its C++ side then casts back to an array (pybind11's
`cast<py::array>`: through a float64 array, then a float32 one) before copying it into onnxruntime's tensor. At one
token the outputs are small; a prefill of 128 tokens through a 2,816-row layer hands 360,448 Python floats back per
node, which took longer than the product itself. `array_outputs()` installs a hook with the same dispatch (the
functions of `_ocos.Opdef._odlist`, their attributes cast by `Opdef.cast_attributes`) that returns each numeric
output as a contiguous array instead: the C++ side casts it without a conversion and copies it with one `memcpy`,
the same values. Outputs of other dtypes (strings, objects) go back as lists, as before. The hook serves every
Python operator of the process, ours and anyone's.

`tests/compat/test_onnxruntime_extensions.py` fails when one disappears or changes meaning.
"""

from __future__ import annotations

import numpy as np

CHECKED_AGAINST = "0.15.2"

__all__ = ["CHECKED_AGAINST", "array_outputs"]

_INSTALLED = False


def _as_output(value):
    """What the C++ side reads of one output: its shape and its values (a contiguous array where numeric)."""
    array = np.asarray(value)
    if array.dtype.kind in "biuf":
        return array.shape, np.ascontiguousarray(array).reshape(-1)
    return array.shape, array.flatten().tolist()


def _invoke(k_id, feed, attributes):
    from onnxruntime_extensions._ocos import Opdef

    op = Opdef._odlist.get(k_id)
    if op is None:
        raise RuntimeError(f"Unable to find function id={k_id}. Did you decorate the operator with @onnx_op?")
    result = op.body(*feed, **op.cast_attributes(attributes))
    outputs = result if isinstance(result, tuple) else (result,)
    return (k_id, *(part for value in outputs for part in _as_output(value)))


def array_outputs() -> None:
    """Make onnxruntime-extensions hand Python operators' numeric outputs back as arrays (once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from onnxruntime_extensions._ocos import PyCustomOpDef

    PyCustomOpDef.install_hooker(_invoke)
    _INSTALLED = True
