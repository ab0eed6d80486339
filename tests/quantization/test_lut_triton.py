"""The Triton LUT-GEMV kernel (`_lut_triton.py`, the CUDA path of packed inference) on CPU under Triton's
interpreter: the same products as the torch definition it implements, within float32 rounding of the reduction,
for 3 and 4 bits, block scales, tables per tensor / per channel, vectors (`cluster_dim=2`), fp32 and bf16 inputs.

Runs in a fresh process (`TRITON_INTERPRET=1` is read when triton compiles a kernel); skipped where triton is not
installed (`pip install --no-deps triton`). On CUDA: tests/gpu/test_dkm_lut.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install --no-deps triton)"
)

SCRIPT = textwrap.dedent(
    """
    import torch
    from hf_llmkit.quantization._lut_triton import lut_gemv
    from tests.quantization.test_lut_gemv import CASES, packed_pair, _fused, ROWS, COLS
    for name in sorted(CASES):
        _, packed = packed_pair(name)
        scale = None if packed.weight_scale is None else packed.weight_scale.float()
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(2, COLS).to(dtype)
            got = lut_gemv(x, packed.weight_packed, packed.weight_lut.float(), scale, ROWS, packed.settings.bits)
            torch.testing.assert_close(got, _fused(packed, x), rtol=1e-5, atol=1e-5)
            print("ok", name, dtype)
    """
)


def test_triton_kernel_under_the_interpreter_matches_the_torch_definition():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("ok ") == 14, proc.stdout
