"""Packed inference (`hf_llmkit.quantization.lut_gemv`): every path gives today's decode's result.

The decoded path (prefill, `HF_LLMKIT_DKM_KERNEL=eager`) and the embedding rows are bit for bit the hard assignment's
weight; the fused LUT-GEMV (its torch definition, and torch.compile of it) within float32 rounding of the reduction;
a failed compile falls back to the decoded path with one log line; a reloaded model saves the same tensors.
Triton's kernel: tests/quantization/test_lut_triton.py (interpreter); CUDA: tests/gpu/test_dkm_lut.py; the C kernel:
tests/quantization/test_lut_native.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import (
    DKMEmbedding,
    DKMLinear,
    DKMSettings,
    PalettizedEmbedding,
    PalettizedLinear,
    lut_gemv,
    quantize_model,
)
from hf_llmkit.testing import tiny_llama
from tests import warm

REPO = Path(__file__).resolve().parents[2]
ROWS, COLS = 48, 96
CASES = {  # name: (DKMSettings.build options, bias)
    "3bit": (dict(bits=3), True),
    "4bit": (dict(bits=4), False),
    "3bit_scales": (dict(bits=3, scale_block_size=16), True),
    "4bit_scales_fp16": (dict(bits=4, scale_block_size=32, lut_dtype="float16"), True),
    "3bit_per_channel": (dict(bits=3, groups=ROWS), True),
    "4bit_per_channel_scales": (dict(bits=4, groups=ROWS // 4, scale_block_size=16), False),
    "4bit_cluster_dim2": (dict(bits=4, cluster_dim=2), True),
}


def _settings(options: dict) -> DKMSettings:
    options = dict(options)
    return DKMSettings.build(ROWS, groups=options.pop("groups", 1), **options)


def packed_pair(name: str, seed: int = 0) -> tuple[DKMLinear, PalettizedLinear]:
    """A trained-looking DKM Linear and the packed layer loaded from its compact export."""
    options, bias = CASES[name]
    torch.manual_seed(seed)
    settings = _settings(options)
    dkm = DKMLinear(COLS, ROWS, bias, settings)
    torch.nn.init.normal_(dkm.weight, std=0.05)
    if bias:
        torch.nn.init.normal_(dkm.bias, std=0.1)
    dkm.init_centroids()
    packed = PalettizedLinear(COLS, ROWS, bias, settings)
    state = dkm.export()
    if bias:
        state["bias"] = dkm.bias.detach().clone()
    packed.load_state_dict(state)
    packed.check_packed("layer")
    return dkm.eval(), packed.eval()


def _fused(layer: PalettizedLinear, x: torch.Tensor) -> torch.Tensor:
    scale = None if layer.weight_scale is None else layer.weight_scale.float()
    lut = layer.weight_lut.float()
    return lut_gemv.fused_lut_gemv(x, layer.weight_packed, lut, scale, ROWS, layer.settings.bits)


@pytest.mark.parametrize("name", sorted(CASES))
def test_decoded_weight_is_the_hard_assignment_bitwise(name):
    dkm, packed = packed_pair(name)
    assert torch.equal(packed.dequantized_weight(torch.float32), dkm.hard_weight(torch.float32))
    assert torch.equal(packed.dequantized_weight(torch.bfloat16), dkm.hard_weight(torch.bfloat16))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_definition_matches_decode(name, dtype):
    """The one torch definition the compiled and Triton kernels implement: within float32 rounding of the
    reduction against the weight decoded and rounded to `x`'s dtype."""
    _, packed = packed_pair(name)
    x = torch.randn(3, COLS).to(dtype)
    want = x.float() @ packed.dequantized_weight(dtype).float().t()
    got = _fused(packed, x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["3bit", "3bit_scales", "3bit_per_channel"])
def test_eager_path_is_todays_forward_bitwise(name, monkeypatch):
    monkeypatch.setenv(lut_gemv.ENV, "eager")
    dkm, packed = packed_pair(name)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 5, COLS).to(dtype)
        bias = None if packed.bias is None else packed.bias.to(dtype)
        with torch.no_grad():
            assert torch.equal(packed(x), F.linear(x, dkm.hard_weight(dtype), bias))


def test_long_inputs_decode_bitwise():
    """Prefill (more than MAX_FUSED_TOKENS tokens) decodes the weight: the same bits as the hard assignment."""
    dkm, packed = packed_pair("4bit_scales_fp16")
    x = torch.randn(1, lut_gemv.MAX_FUSED_TOKENS + 1, COLS)
    with torch.no_grad():
        assert torch.equal(packed(x), dkm(x))


def test_inputs_that_need_a_gradient_take_the_decoded_path():
    dkm, packed = packed_pair("3bit")
    x = torch.randn(1, COLS, requires_grad=True)
    packed(x).sum().backward()
    want = torch.ones(1, ROWS) @ dkm.hard_weight(torch.float32)
    assert torch.equal(x.grad, want)
    assert packed.bias.grad is not None


def test_autocast_computes_in_autocast_dtype():
    """Under CPU autocast the product runs in bf16, as F.linear's: the fused path rounds the weight and output."""
    dkm, packed = packed_pair("3bit_scales")
    x = torch.randn(1, COLS)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = packed(x)
        want = F.linear(x, dkm.hard_weight(torch.float32), packed.bias)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "options", [dict(embedding_bits=3), dict(embedding_bits=8, scale_block_size=8), dict(embedding_bits=4, groups=4)]
)
def test_embedding_rows_are_the_decoded_table_bitwise(options):
    torch.manual_seed(0)
    options = dict(options)
    settings = DKMSettings.build(64, groups=options.pop("groups", 1), kind="embedding", **options)
    emb = DKMEmbedding(64, 32, None, settings)
    torch.nn.init.normal_(emb.weight)
    emb.init_centroids()
    packed = PalettizedEmbedding(64, 32, None, settings)
    packed.load_state_dict(emb.export())
    ids = torch.tensor([[0, 5, 63, 5], [17, 2, 40, 1]])
    assert torch.equal(packed(ids), F.embedding(ids, emb.hard_weight(torch.float32)))
    with pytest.raises(IndexError, match=r"\[0, 64\)"):
        packed(torch.tensor([64]))


def test_unknown_path_is_refused(monkeypatch):
    monkeypatch.setenv(lut_gemv.ENV, "fastest")
    with pytest.raises(ValueError, match="HF_LLMKIT_DKM_KERNEL='fastest'.*auto, eager, native, compile, triton"):
        lut_gemv.requested_path()


@pytest.mark.parametrize("name", ["3bit_per_channel", "4bit_scales_fp16"])
def test_compiled_path_matches_decode(name, monkeypatch):
    """torch.compile of the definition (inductor's C++ on CPU) is used and agrees; no fallback happened."""
    monkeypatch.setenv(lut_gemv.ENV, "compile")
    _, packed = packed_pair(name)
    x = torch.randn(1, 1, COLS)
    with torch.no_grad():
        got = packed(x)
    assert "cpu" not in lut_gemv._broken, "torch.compile failed here: the decoded path answered"
    want = F.linear(x, packed.dequantized_weight(torch.float32), packed.bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


FALLBACK = textwrap.dedent(
    """
    import logging, os, torch
    import torch._inductor.config as inductor
    # inductor reads $CXX when it is first imported: in this process forked from the warm interpreter, already done
    inductor.cpp.cxx = (None, os.environ["CXX"])
    from tests.quantization.test_lut_gemv import packed_pair, COLS
    logging.basicConfig(level=logging.INFO)
    _, packed = packed_pair("3bit_scales")
    x = torch.randn(1, COLS)
    with torch.no_grad():
        got, again = packed(x), packed(x)
    want = torch.nn.functional.linear(x, packed.dequantized_weight(torch.float32), packed.bias)
    assert torch.equal(got, want) and torch.equal(again, want)
    print("FALLBACK OK")
    """
)


def test_without_a_compiler_the_decoded_path_answers_and_says_so_once(tmp_path):
    """A real failed compile (inductor pointed at a C++ compiler that does not exist, empty cache): the layer answers
    through the decoded path, bit for bit, and one warning names the fallback."""
    env = dict(CXX=str(tmp_path / "no-such-c++"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    env[lut_gemv.ENV] = "compile"  # the C kernel's own missing-compiler case: tests/quantization/test_lut_native.py
    (tmp_path / "fallback.py").write_text(FALLBACK)
    proc = warm.run_script(tmp_path / "fallback.py", env=env, cwd=REPO)  # a new process, forked warm
    assert proc.returncode == 0 and "FALLBACK OK" in proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.count("multiply with the eager path (torch.compile failed") == 1, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def compact(tmp_path_factory):
    root = tmp_path_factory.mktemp("lut_gemv")
    config = DKMConfig(bits=3, scale_block_size=16, modules_to_not_convert=[], quantize_embeddings=True)
    quantize_model(tiny_llama(), config).save_pretrained(root / "compact")
    return root


def test_reloaded_model_generates_like_the_decoded_path_and_saves_the_same_tensors(compact, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(compact / "compact").eval()
    assert isinstance(model.lm_head, PalettizedLinear)
    assert isinstance(model.model.embed_tokens, PalettizedEmbedding)
    ids = torch.tensor([[1, 7, 3, 9]])
    with torch.no_grad():
        fast = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        monkeypatch.setenv(lut_gemv.ENV, "eager")
        slow = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(fast.sequences, slow.sequences)
    for a, b in zip(fast.logits, slow.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    model.save_pretrained(compact / "again")
    before = load_file(compact / "compact" / "model.safetensors")
    after = load_file(compact / "again" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert value.dtype == after[key].dtype and torch.equal(value, after[key]), key


def test_the_prefill_switch_keeps_a_large_weight_decoded_whole_fused_longer():
    """`decodes`: fused up to MAX_FUSED_TOKENS tokens; a weight of LARGE_WEIGHTS entries or more (an LM head) decoded
    whole stays fused up to MAX_FUSED_TOKENS_LARGE; decoded in blocks (the ONNX kernels) it switches with the others
    (the crossovers measured by benchmarks/areas/inference/switch.py)."""
    small, large, n, n_large = (
        576 * 576,
        lut_gemv.LARGE_WEIGHTS,
        lut_gemv.MAX_FUSED_TOKENS,
        lut_gemv.MAX_FUSED_TOKENS_LARGE,
    )
    assert n < n_large
    assert not lut_gemv.decodes(n, small) and lut_gemv.decodes(n + 1, small)
    assert not lut_gemv.decodes(n_large, large) and lut_gemv.decodes(n_large + 1, large)
    assert lut_gemv.decodes(n + 1, large, blocked=True) and not lut_gemv.decodes(n, large, blocked=True)
