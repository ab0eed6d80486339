"""Packed DKM inference on CUDA: the Triton LUT-GEMV kernel and torch.compile's kernel (inductor's Triton) give the
decoded weight's products within float32 rounding, for every layer kind of tests/quantization/test_lut_gemv.py and
fp32 / bf16 inputs; a reloaded compact model on the GPU generates the same tokens with logits within rounding of the
decoded path, and picks the Triton path by itself.

CPU counterparts: tests/quantization/test_lut_gemv.py, tests/quantization/test_lut_triton.py (interpreter).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import lut_gemv, quantize_model
from hf_llmkit.testing import tiny_llama
from tests.quantization.test_lut_gemv import CASES, COLS, ROWS, packed_pair

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["triton", "compile"])
def test_fused_kernels_on_cuda_match_the_decoded_product(name, dtype, path, monkeypatch):
    monkeypatch.setenv(lut_gemv.ENV, path)
    _, packed = packed_pair(name)
    packed = packed.cuda()
    x = torch.randn(3, COLS, device="cuda").to(dtype)
    with torch.no_grad():
        got = packed(x)
    assert "cuda" not in lut_gemv._broken, "torch.compile failed on CUDA: the decoded path answered"
    bias = None if packed.bias is None else packed.bias.to(dtype)
    want = (x.float() @ packed.dequantized_weight(dtype).float().t() + (0 if bias is None else bias.float())).to(dtype)
    assert got.dtype == dtype and got.shape == (3, ROWS)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_decoded_path_on_cuda_is_the_cpu_decode_bitwise():
    _, packed = packed_pair("4bit_per_channel_scales")
    cpu = packed.dequantized_weight(torch.float32)
    assert torch.equal(packed.cuda().dequantized_weight(torch.float32).cpu(), cpu)


def test_reloaded_model_on_cuda_generates_like_the_decoded_path(tmp_path, monkeypatch, caplog):
    config = DKMConfig(bits=3, scale_block_size=16, modules_to_not_convert=[], quantize_embeddings=True)
    quantize_model(tiny_llama(), config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).cuda().eval()
    ids = torch.tensor([[1, 7, 3, 9]], device="cuda")
    monkeypatch.delenv(lut_gemv.ENV, raising=False)
    lut_gemv._logged.clear()
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger=lut_gemv.__name__):
        fast = model.generate(ids, **kwargs)
        monkeypatch.setenv(lut_gemv.ENV, "eager")
        slow = model.generate(ids, **kwargs)
    assert "multiply with the triton path" in caplog.text
    assert torch.equal(fast.sequences, slow.sequences)
    for a, b in zip(fast.logits, slow.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    prompt = F.pad(ids, (0, 12), value=5)  # prefill of 16 tokens: the decoded path, same logits bit for bit
    monkeypatch.setenv(lut_gemv.ENV, "auto")
    with torch.no_grad():
        auto = model(prompt).logits
        monkeypatch.setenv(lut_gemv.ENV, "eager")
        assert torch.equal(auto, model(prompt).logits)
