"""The C kernel of the packed layers (`hf_llmkit.quantization._lut_native`) on this machine's CPU.

Its decode is bit for bit the hard assignment's weight in float32, bfloat16 and float16, in each of its loops
(AVX-512 where the CPU has VBMI, AVX2, NEON on AArch64, portable; the NEON loop is also run under qemu against the
portable one in `test_lut_neon.py`); its product is within float32 rounding of `F.linear` by that weight;
`auto` takes it on CPU; without a C compiler the layers answer through the torch paths with one warning, and asking
for it by name is refused in one line.
"""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import torch.nn.functional as F

from hf_llmkit.quantization import DKMLinear, DKMSettings, PalettizedLinear, lut_gemv
from hf_llmkit.quantization import _lut_native as native

ROWS = 24
# name: (cols, DKMSettings.build options). Each loop's paths: the AVX2 chunks of 64 columns (block scales of 64k
# columns or none) and its 8-column words (smaller blocks, the tail after the last chunk: 200 = 3 x 64 + 8), the
# 3-bit chunk loads near the end of the stream, tables repeated to 8 entries (1-2 bits) or split in two (4 bits),
# per-weight lookups of 5-8 bit tables, tables per group of rows, and block sizes no SIMD loop takes (4 columns).
CASES = {
    "1bit": (128, dict(bits=1)),
    "2bit": (192, dict(bits=2)),
    "2bit_scales8_tail": (264, dict(bits=2, scale_block_size=8)),
    "2bit_scales128": (384, dict(bits=2, scale_block_size=128)),
    "3bit_tail": (200, dict(bits=3)),
    "3bit_scales64_groups": (128, dict(bits=3, scale_block_size=64, groups=4, lut_dtype="bfloat16")),
    "3bit_scales16_fp16": (192, dict(bits=3, scale_block_size=16, lut_dtype="float16")),
    "4bit_scales64": (256, dict(bits=4, scale_block_size=64)),
    "4bit_per_channel_scales32": (128, dict(bits=4, scale_block_size=32, groups=ROWS)),
    "4bit_groups_scales8": (64, dict(bits=4, scale_block_size=8, groups=6)),
    "4bit_scales_bf16": (128, dict(bits=4, scale_block_size=32, lut_dtype="bfloat16")),
    "4bit_scales4": (64, dict(bits=4, scale_block_size=4)),  # blocks of 4 columns: the portable loops only
    "5bit": (128, dict(bits=5)),
    "6bit_scales16": (72, dict(bits=6, scale_block_size=8)),
    "8bit": (136, dict(bits=8, lut_dtype="bfloat16")),
    "8bit_scales": (64, dict(bits=8, scale_block_size=32)),
    # 16-bit tables of 8 bits (embeddings): the AVX-512 word-permute loop, its 32-column chunks and tail
    "8bit_scales32_fp16_groups": (96, dict(bits=8, scale_block_size=32, lut_dtype="float16", groups=3)),
    "8bit_bf16_tail": (200, dict(bits=8, lut_dtype="bfloat16")),
}


@pytest.fixture(params=native.LOOPS)
def loops(request):
    if native.library() is None:
        pytest.fail(f"the C kernel did not build here: {native.unavailable_reason()}")
    if request.param not in native.available_loops():
        pytest.skip(f"this CPU cannot run the {request.param} loops")
    native.cap_loops(request.param)
    yield request.param
    native.cap_loops(native.LOOPS[-1])


@functools.cache  # read-only pairs, shared by every loop level's tests
def packed_pair(name: str) -> tuple[DKMLinear, PalettizedLinear]:
    cols, options = CASES[name]
    options = dict(options)
    torch.manual_seed(0)
    settings = DKMSettings.build(ROWS, groups=options.pop("groups", 1), **options)
    dkm = DKMLinear(cols, ROWS, True, settings)
    torch.nn.init.normal_(dkm.weight, std=0.05)
    torch.nn.init.normal_(dkm.bias, std=0.1)
    dkm.init_centroids()
    packed = PalettizedLinear(cols, ROWS, True, settings)
    packed.load_state_dict({**dkm.export(), "bias": dkm.bias.detach().clone()})
    return dkm.eval(), packed.eval()


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_is_the_hard_assignment_bitwise(name, loops):
    dkm, packed = packed_pair(name)
    assert native.supports(packed)
    for dtype in native.DECODE_DTYPES:
        assert torch.equal(native.decode(packed, dtype), dkm.hard_weight(dtype)), dtype


@pytest.mark.parametrize("name", sorted(CASES))
def test_product_is_the_decoded_linear_within_float32_rounding(name, loops):
    """1 to 11 tokens (over 8 takes two passes) in each compute dtype (bfloat16 inputs take the AVX512-BF16 loops
    where the CPU has them); each weight rounded to that dtype, as the decoded path's; the output rounded into the
    compute dtype by the kernel is the float32 one rounded by torch, bit for bit."""
    dkm, packed = packed_pair(name)
    for dtype in native.DECODE_DTYPES:
        w = dkm.hard_weight(dtype).float()
        for tokens in (1, 2, 5, 8, 11):
            x = torch.randn(tokens, w.shape[1]).to(dtype)
            want = x.float() @ w.T
            got = native.gemv(packed, x, dtype)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(native.gemv(packed, x, dtype, dtype), got.to(dtype))


@pytest.mark.parametrize("name", ["3bit_tail", "4bit_scales64", "8bit_scales"])
def test_threads_share_rows_and_change_no_bit(name, loops):
    dkm, packed = packed_pair(name)
    x = torch.randn(3, CASES[name][0])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.gemv(packed, x, torch.float32)
        torch.set_num_threads(2)
        assert torch.equal(native.gemv(packed, x, torch.float32), one)
        assert torch.equal(native.decode(packed, torch.bfloat16), dkm.hard_weight(torch.bfloat16))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["3bit_tail", "6bit_scales16", "8bit"])
def test_rows_lookup_is_the_decoded_rows_bitwise(name):
    dkm, packed = packed_pair(name)
    ids = torch.tensor([[0, 23, 5], [5, 5, 11]])
    for dtype in native.DECODE_DTYPES:
        assert torch.equal(native.decode_rows(packed, ids, dtype), dkm.hard_weight(dtype)[ids]), dtype


def test_the_loops_a_cpu_takes_are_named_and_capped_in_one_line():
    assert native.loops(3) in native.LOOPS and native.loops(8, 32, bf16_inputs=True) in native.LOOPS
    assert native.loops(4, 4) == "portable"  # blocks of 4 columns: no SIMD loop takes them
    if "avx512" in native.available_loops():  # 8-bit tables saved in 16 bits: the AVX-512 loop; in 32 bits: AVX2
        assert native.loops(8, 32, table_dtype=torch.bfloat16) == "avx512" == native.loops(8, 0, True, torch.float16)
        assert native.loops(8, 32, table_dtype=torch.float32) == "avx2" == native.loops(8, 16, True, torch.bfloat16)
    assert native.available_loops()[-1] == "portable" and native.loops(3) in native.available_loops()
    with pytest.raises(ValueError, match="use one of portable, avx2, avx512, avx512_bf16, neon"):
        native.cap_loops("sve")
    native.cap_loops("portable")
    try:
        assert native.loops(3) == "portable"
    finally:
        native.cap_loops(native.LOOPS[-1])


def test_the_operator_torch_compile_captures_is_the_kernel(loops):
    """`gemv_op` (what a compiled graph calls) gives the eager kernel's bits; its fake gives the shape and dtype."""
    _, packed = packed_pair("4bit_scales_bf16")
    x = torch.randn(2, 1, 128).bfloat16()
    s = packed.settings
    args = (packed.weight_packed, packed.weight_lut, packed.weight_scale, ROWS, s.bits, s.groups, torch.bfloat16)
    got = native.gemv_op(x, *args, torch.bfloat16)
    assert got.shape == (2, 1, ROWS) and torch.equal(got, native.gemv(packed, x, torch.bfloat16, torch.bfloat16))
    torch.library.opcheck(torch.ops.hf_llmkit.lut_gemv.default, (x, *args, torch.float32))


def test_auto_takes_the_kernel_on_cpu_and_the_layer_agrees(monkeypatch, caplog):
    monkeypatch.delenv(lut_gemv.ENV, raising=False)
    dkm, packed = packed_pair("3bit_scales16_fp16")
    assert lut_gemv.choose_path(torch.device("cpu"), packed) == "native"
    x = torch.randn(2, 1, 192)
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            got = packed(x.to(dtype))
            want = F.linear(x.to(dtype).float(), dkm.hard_weight(dtype).float(), dkm.bias.detach())
        assert got.dtype == dtype
        torch.testing.assert_close(
            got.float(),
            want.to(dtype).float(),
            rtol=1e-2 if dtype != torch.float32 else 1e-5,
            atol=1e-2 if dtype != torch.float32 else 1e-5,
        )
    # prefill decodes through the kernel: F.linear by the hard weight, bit for bit
    long = torch.randn(1, lut_gemv.MAX_FUSED_TOKENS + 3, 192)
    with torch.no_grad():
        assert torch.equal(packed(long), F.linear(long, dkm.hard_weight(torch.float32), dkm.bias.detach()))


def test_a_layer_the_kernel_does_not_serve_takes_the_torch_paths():
    torch.manual_seed(0)
    settings = DKMSettings.build(8, bits=4, cluster_dim=2)
    dkm = DKMLinear(64, 8, False, settings)
    dkm.init_centroids()
    packed = PalettizedLinear(64, 8, False, settings)
    packed.load_state_dict(dkm.export())
    assert not native.supports(packed)
    assert lut_gemv.choose_path(torch.device("cpu"), packed) in ("compile", "eager")
    assert torch.equal(packed.dequantized_weight(torch.float32), dkm.hard_weight(torch.float32))


def test_without_a_c_compiler_the_torch_paths_answer_and_say_so_once(without_a_c_compiler, monkeypatch, caplog):
    monkeypatch.delenv(lut_gemv.ENV, raising=False)
    monkeypatch.setattr(lut_gemv, "_logged", set())  # this process's "said once" records, as a new process has them
    monkeypatch.setattr(lut_gemv, "_broken", set())
    dkm, packed = packed_pair.__wrapped__("4bit_scales64")  # layers that never met the kernel
    x = torch.randn(1, 256)
    with caplog.at_level(logging.INFO), torch.no_grad():
        got, again = packed(x), packed(x)
    want = F.linear(x, dkm.hard_weight(torch.float32), dkm.bias.detach())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, again)
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith("The DKM CPU kernel is not available (") for line in lines) == 1, lines
    assert not list(without_a_c_compiler.glob("kernels/*.so"))


def test_asking_for_the_kernel_without_a_compiler_is_one_line(without_a_c_compiler, monkeypatch):
    monkeypatch.setenv(lut_gemv.ENV, "native")
    _, packed = packed_pair.__wrapped__("4bit_scales64")
    with pytest.raises(ValueError) as refused, torch.no_grad():
        packed(torch.randn(1, 256))
    line = str(refused.value)
    assert line.startswith("HF_LLMKIT_DKM_KERNEL=native but the C kernel did not build") and "\n" not in line
    assert "does not run (No such file or directory): install gcc, or set $CC" in line


def test_the_build_is_cached_per_source(tmp_path, monkeypatch):
    """A fresh cache builds the library once, under a name carrying the source's hash; a second process loads it
    (each process has its own unbuilt kernel object: two copies of it here, in place of two interpreters)."""
    monkeypatch.setenv("HF_LLMKIT_CACHE", str(tmp_path))

    def new_process_kernel():
        kernel = copy.copy(native._KERNEL)
        kernel._lib, kernel._error = None, None
        return kernel

    first = new_process_kernel()
    assert first.library() is not None, first.unavailable_reason()
    built = list((tmp_path / "kernels").iterdir())
    assert [p.name for p in built] == [first.path().name] and first.path().name.startswith("lut-")
    mtime = built[0].stat().st_mtime_ns
    again = new_process_kernel()
    assert again.library() is not None and built[0].stat().st_mtime_ns == mtime
    assert list((tmp_path / "kernels").iterdir()) == built
