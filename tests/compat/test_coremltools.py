"""coremltools still offers what hf_llmkit.compat.coremltools relies on, with the meaning it relies on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

ct = pytest.importorskip("coremltools", reason="the Core ML export needs coremltools (the `export` extra)")

from hf_llmkit.compat.coremltools import CHECKED_AGAINST, fix_scalar_casts, load_program  # noqa: E402

WHERE = f"coremltools {ct.__version__} (checked against {CHECKED_AGAINST})"


class _Flatten(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1) * 2.0  # traced: aten::size -> aten::Int -> reshape


def test_scalar_casts_convert_and_a_saved_program_reads_back(tmp_path):
    fix_scalar_casts()
    traced = torch.jit.trace(_Flatten(), (torch.ones(2, 3, 4),))
    inputs = [ct.TensorType(name="x", shape=(2, 3, 4))]
    options = dict(minimum_deployment_target=ct.target.iOS18, compute_precision=ct.precision.FLOAT32)
    model = ct.convert(traced, inputs=inputs, convert_to="mlprogram", skip_model_load=True, **options)
    model.save(str(tmp_path / "flat.mlpackage"))
    program = load_program(tmp_path / "flat.mlpackage")
    ops = [op.op_type for op in program.functions["main"].operations]
    assert "reshape" in ops and "mul" in ops, f"{WHERE}: {ops}"
    (reshape,) = [op for op in program.functions["main"].operations if op.op_type == "reshape"]
    assert list(np.asarray(reshape.shape.val)) in ([2, 12], [2, -1]), f"{WHERE}: the cast size is lost"
