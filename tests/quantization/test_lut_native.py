"""The C kernel of the packed layers (`hf_llmkit.quantization._lut_native`) on this machine's CPU.

Its decode is bit for bit the hard assignment's weight in float32, bfloat16 and float16, in each of its loops
(AVX-512 where the CPU has VBMI, AVX2, portable); its product is within float32 rounding of `F.linear` by that weight;
`auto` takes it on CPU; without a C compiler the layers answer through the torch paths with one warning, and asking
for it by name is refused in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from hf_llmkit.quantization import DKMLinear, DKMSettings, PalettizedLinear, lut_gemv
from hf_llmkit.quantization import _lut_native as native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = 24
CASES = {  # name: (cols, DKMSettings.build options); 200 columns leave a tail of 8 after three chunks of 64
    "2bit": (192, dict(bits=2)),
    "3bit_tail": (200, dict(bits=3)),
    "3bit_scales16_fp16": (192, dict(bits=3, scale_block_size=16, lut_dtype="float16")),
    "4bit_scales64": (256, dict(bits=4, scale_block_size=64)),
    "4bit_per_channel_scales32": (128, dict(bits=4, scale_block_size=32, groups=ROWS)),
    "4bit_groups_scales8": (64, dict(bits=4, scale_block_size=8, groups=6)),  # 8 columns: the portable loops
    "4bit_scales_bf16": (128, dict(bits=4, scale_block_size=32, lut_dtype="bfloat16")),
    "5bit": (128, dict(bits=5)),
    "8bit_scales": (64, dict(bits=8, scale_block_size=32)),
}


@pytest.fixture(params=native.LOOPS)
def loops(request):
    if native.library() is None:
        pytest.fail(f"the C kernel did not build here: {native.unavailable_reason()}")
    best = max(native.LOOPS.index(native.loops(4, bf16_inputs=b)) for b in (False, True))
    if native.LOOPS.index(request.param) > best:
        pytest.skip(f"this CPU cannot run the {request.param} loops")
    native.cap_loops(request.param)
    yield request.param
    native.cap_loops(native.LOOPS[-1])


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
    where the CPU has them); each weight rounded to that dtype, as the decoded path's."""
    dkm, packed = packed_pair(name)
    for dtype in native.DECODE_DTYPES:
        w = dkm.hard_weight(dtype).float()
        for tokens in (1, 2, 5, 8, 11):
            x = torch.randn(tokens, w.shape[1]).to(dtype)
            want = x.float() @ w.T
            torch.testing.assert_close(native.gemv(packed, x, dtype), want, rtol=1e-5, atol=1e-5)


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


NO_COMPILER = textwrap.dedent(
    """
    import logging, os, torch
    from tests.quantization.test_lut_native import packed_pair
    from hf_llmkit.quantization import lut_gemv
    logging.basicConfig(level=logging.INFO)
    dkm, packed = packed_pair("4bit_scales64")
    x = torch.randn(1, 256)
    if os.environ.get("HF_LLMKIT_DKM_KERNEL") == "native":
        try:
            with torch.no_grad():
                packed(x)
        except ValueError as error:
            print("REFUSED", error)
        raise SystemExit(0)
    with torch.no_grad():
        got, again = packed(x), packed(x)
    want = torch.nn.functional.linear(x, dkm.hard_weight(torch.float32), dkm.bias.detach())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, again)
    print("TORCH PATHS OK")
    """
)


def _without_compiler(tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if k != lut_gemv.ENV}
    env = dict(base, CC=str(tmp_path / "no-such-cc"), HF_LLMKIT_CACHE=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable, "-c", NO_COMPILER], env=env, cwd=ROOT, capture_output=True, text=True)


def test_without_a_c_compiler_the_torch_paths_answer_and_say_so_once(tmp_path):
    proc = _without_compiler(tmp_path)
    assert proc.returncode == 0 and "TORCH PATHS OK" in proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.count("The DKM CPU kernel is not available (") == 1, proc.stderr[-3000:]
    assert not (tmp_path / "cache" / "kernels").exists() or not any((tmp_path / "cache" / "kernels").glob("*.so"))


def test_asking_for_the_kernel_without_a_compiler_is_one_line(tmp_path):
    proc = _without_compiler(tmp_path, HF_LLMKIT_DKM_KERNEL="native")
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip()
    assert line.startswith("REFUSED HF_LLMKIT_DKM_KERNEL=native but the C kernel did not build") and "\n" not in line
    assert "does not run (No such file or directory): install gcc, or set $CC" in line


def test_the_build_is_cached_per_source(tmp_path):
    """A fresh cache builds the library once, under a name carrying the source's hash; a second process loads it."""
    env = dict(os.environ, HF_LLMKIT_CACHE=str(tmp_path))
    code = "from hf_llmkit.quantization import _lut_native as n; assert n.library(); print(n.library_path())"
    first = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    built = list((tmp_path / "kernels").iterdir())
    assert [p.name for p in built] == [os.path.basename(first.stdout.strip())]
    mtime = built[0].stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0 and built[0].stat().st_mtime_ns == mtime
