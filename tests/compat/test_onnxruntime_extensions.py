"""onnxruntime-extensions still offers what hf_llmkit.compat.onnxruntime_extensions relies on, with the meaning it
relies on: its hook returns what the package's own does (arrays for lists), and a session reads them back."""

from __future__ import annotations

import numpy as np
import pytest

ext = pytest.importorskip("onnxruntime_extensions", reason="the ONNX kernels need onnxruntime-extensions (`export`)")
ort = pytest.importorskip("onnxruntime", reason="the ONNX export needs onnxruntime (the `export` extra)")

from onnxruntime_extensions import PyCustomOpDef, _ocos, onnx_op  # noqa: E402

from hf_llmkit.compat.onnxruntime_extensions import CHECKED_AGAINST, _invoke, array_outputs  # noqa: E402

WHERE = f"onnxruntime-extensions {ext.__version__} (checked against {CHECKED_AGAINST})"


def _halves_and_counts(x):
    return (x / 2).astype(np.float32), np.array([x.size, x.ndim], dtype=np.int64)


OP = onnx_op(op_type="LlmkitCompatHalves", inputs=[PyCustomOpDef.dt_float],
             outputs=[PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64])(_halves_and_counts)  # fmt: skip


def test_the_hook_returns_the_package_hooks_values_as_arrays_and_a_session_reads_them(tmp_path):
    from onnx import TensorProto, helper, save

    assert callable(_ocos._on_pyop_invocation) and callable(PyCustomOpDef.install_hooker), WHERE
    assert _ocos.Opdef._odlist[OP._nativedef.obj_id] is OP and OP.cast_attributes({}) == {}, WHERE
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    theirs, ours = _ocos._on_pyop_invocation(OP._nativedef.obj_id, [x], {}), _invoke(OP._nativedef.obj_id, [x], {})
    assert len(theirs) == len(ours) == 5 and theirs[0] == ours[0], WHERE
    for (shape, values), (our_shape, our_values) in zip(zip(theirs[1::2], theirs[2::2]), zip(ours[1::2], ours[2::2])):
        assert tuple(shape) == tuple(our_shape) and isinstance(our_values, np.ndarray), WHERE
        assert our_values.flags.c_contiguous and our_values.tolist() == values, WHERE
    array_outputs()
    node = helper.make_node("LlmkitCompatHalves", ["x"], ["y", "n"], domain="ai.onnx.contrib")
    graph = helper.make_graph(
        [node],
        "halves",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("n", TensorProto.INT64, None)],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.contrib", 1)]
    save(helper.make_model(graph, opset_imports=opsets), str(tmp_path / "halves.onnx"))
    options = ort.SessionOptions()
    options.register_custom_ops_library(ext.get_library_path())
    y, n = ort.InferenceSession(str(tmp_path / "halves.onnx"), options).run(None, {"x": x})
    assert y.dtype == np.float32 and np.array_equal(y, x / 2) and n.tolist() == [12, 2], WHERE
