"""The DKM CPU kernel's NEON loop (AArch64: Apple silicon, Graviton) gives the portable loop's bits, tested without
ARM hardware: the kernel's sources and a small C driver (`lut_neon_driver.c`) cross-compiled with Debian's
`aarch64-linux-gnu-gcc` and run under `qemu-aarch64` (qemu-user), against this machine's own build of the kernel
capped to its portable loop. Products of 1 to 11 tokens and decoded weights, 1-4 bit tables (the NEON loop's) with
and without block scales (blocks of 8 to 128 columns, split or not by its 16-column steps), tables per tensor, per
group of rows and per row, every table / scale / input / compute / output dtype; 5 and 8 bit tables and blocks of 4
columns stay on the portable loop, whose bits are the same on both CPUs too (the kernel is built without fused
multiply-adds). It says nothing of the NEON loop's speed: qemu emulates it. Where the tools are missing (CI installs
them: `.ci/run`) the tests skip in one line naming the packages.
"""

from __future__ import annotations

import platform
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from hf_llmkit.native import compiler
from hf_llmkit.quantization import _lut_native as native

DRIVER = Path(__file__).with_name("lut_neon_driver.c")
ON_ARM = platform.machine().lower() in ("aarch64", "arm64")
CROSS, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
PACKAGES = "gcc-aarch64-linux-gnu qemu-user"
NEON, PORTABLE = native.LOOPS.index("neon"), native.LOOPS.index("portable")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# shapes and block scales: (cols, block) with cols a multiple of 8; 200 and 264 end in a half step (8 columns), 72
# in blocks of 24 that do too, 576 is SmolLM2's hidden size, 1536 its MLP's; blocks of 128 and 512 columns are long
# enough for the portable loop's pair tables at 3 and 4 bits (shorter ones at 1-2 bits)
SHAPES = ((200, 0), (576, 64), (264, 8), (192, 16), (384, 128), (72, 24), (1536, 32), (1024, 512), (1024, 0))
# (table, scale, compute mode, input, output) dtypes, taken in turn
DTYPES = (
    (F32, F32, F32, F32, F32),
    (F16, F16, BF16, BF16, BF16),
    (BF16, BF16, F16, F16, F32),
    (F32, BF16, BF16, F32, F32),
    (F16, F32, F16, BF16, F16),
    (BF16, F16, F32, F16, F32),
)
TOKENS = (1, 2, 3, 5, 8, 11)  # 11: two passes over the weight


def cases() -> list[dict]:
    """Every case: its shape, tables per group of rows, dtypes and token count, and whether NEON takes it."""
    out = []
    for bits in (1, 2, 3, 4):
        for cols, block in SHAPES:
            for variant in range(2):  # one token (the decoding loop) and several
                n = len(out)
                rows = (16, 24, 40)[n % 3]
                per_group = (rows, 8, 1)[(n // 3) % 3]  # one table, a table per 8 rows, per row
                table, scale, mode, x, y = DTYPES[n % len(DTYPES)]
                m = 1 if variant == 0 else TOKENS[1 + (n // 2) % (len(TOKENS) - 1)]
                out.append(dict(rows=rows, cols=cols, bits=bits, per_group=per_group, block=block, table=table,
                                scale=scale, mode=mode, x=x, m=m, y=y, neon=True))  # fmt: skip
    for bits, cols, block, m in ((5, 128, 0, 1), (6, 72, 8, 3), (8, 136, 0, 2), (8, 64, 32, 1), (4, 64, 4, 1)):
        out.append(dict(rows=24, cols=cols, bits=bits, per_group=24, block=block, table=F16, scale=F32, mode=BF16,
                        x=F32, m=m, y=F32, neon=False))  # fmt: skip
    return out


def name(case: dict) -> str:
    dtypes = "/".join(str(case[k]).removeprefix("torch.") for k in ("table", "scale", "mode", "x", "y"))
    return (f"{case['bits']}-bit {case['rows']}x{case['cols']} block {case['block']} rows/table {case['per_group']} "
            f"{case['m']} tokens {dtypes}")  # fmt: skip


def tensors(case: dict, seed: int) -> dict:
    """Random indices, tables, scales and inputs (the bits compared do not depend on them being a trained weight)."""
    g = torch.Generator().manual_seed(seed)
    rows, cols, bits = case["rows"], case["cols"], case["bits"]
    out = {
        "packed": torch.randint(0, 256, (rows * cols * bits // 8,), dtype=torch.uint8, generator=g),
        "lut": torch.randn((rows // case["per_group"]) << bits, generator=g).to(case["table"]),
        "x": torch.randn(case["m"], cols, generator=g).to(case["x"]),
        "scale": None,
    }
    if case["block"]:
        out["scale"] = (torch.rand(rows, cols // case["block"], generator=g) + 0.5).to(case["scale"])
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def portable_here(case: dict, t: dict) -> tuple[bytes, bytes]:
    """(y, decoded weight) as bytes from this machine's kernel, capped to its portable loop."""
    lib = native.library()
    rows, cols = case["rows"], case["cols"]
    codes = native._DTYPE_CODES
    args = native.WeightArgs(t["packed"].data_ptr(), rows, cols, case["bits"], t["lut"].data_ptr(),
                             codes[t["lut"].dtype], case["per_group"])  # fmt: skip
    scale = t["scale"]
    if scale is not None:
        args.scale, args.scale_dtype, args.nblocks = scale.data_ptr(), codes[scale.dtype], scale.shape[1]
    mode = native._OUT_CODES[case["mode"]]
    y = torch.empty(case["m"], rows, dtype=case["y"])
    decoded = torch.empty(rows, cols, dtype=case["mode"])
    native.cap_loops("portable")
    try:
        x = t["x"]
        assert lib.lut_gemv(args, mode, x.data_ptr(), codes[x.dtype], case["m"], y.data_ptr(),
                            native._OUT_CODES[case["y"]], 1) == 0  # fmt: skip
        lib.lut_decode(args, mode, decoded.data_ptr(), 1)
    finally:
        native.cap_loops(native.LOOPS[-1])
    return raw(y), raw(decoded)


def case_bytes(case: dict, t: dict) -> bytes:
    """The case as the driver reads it."""
    codes, block = native._DTYPE_CODES, case["block"]
    header = (case["rows"], case["cols"], case["bits"], case["per_group"], case["cols"] // block if block else 0,
              codes[case["table"]], codes[case["scale"]], native._OUT_CODES[case["mode"]], codes[case["x"]],
              case["m"], native._OUT_CODES[case["y"]])  # fmt: skip
    scale = b"" if t["scale"] is None else raw(t["scale"])
    return struct.pack("<11q", *header) + raw(t["packed"]) + raw(t["lut"]) + scale + raw(t["x"])


@pytest.fixture(scope="module")
def arm(tmp_path_factory):
    """Runs the driver built for AArch64 (under qemu on other CPUs) at a loop cap: (stdout bytes)."""
    if native.library() is None:
        pytest.fail(f"the C kernel did not build here: {native.unavailable_reason()}")
    cc, run = ([compiler() or "cc"], []) if ON_ARM else ([CROSS, "-static"], [QEMU])
    missing = [tool for tool in (cc[0], *run) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not found: apt-get install {PACKAGES} (Debian/Ubuntu)")
    binary = tmp_path_factory.mktemp("neon") / "lut_neon_driver"
    source = b"\n".join(path.read_bytes() for path in (*native.SOURCES, DRIVER))
    built = subprocess.run([*cc, "-O3", *native.FLAGS, "-std=gnu11", "-x", "c", "-", "-o", str(binary)],
                           input=source, capture_output=True, timeout=300)  # fmt: skip
    assert built.returncode == 0, built.stderr.decode(errors="replace")[-2000:]

    def at(level: int, stdin: bytes) -> bytes:
        done = subprocess.run([*run, str(binary), str(level)], input=stdin, capture_output=True, timeout=120)
        assert done.returncode == 0, (done.returncode, done.stderr.decode(errors="replace")[-2000:])
        return done.stdout

    return at


def compare(results: bytes, every: list[tuple[dict, dict]], levels_wanted) -> None:
    offset = 0
    for case, t in every:
        y, decoded = portable_here(case, t)
        (level,) = struct.unpack_from("<q", results, offset)
        got_y = results[offset + 8 : offset + 8 + len(y)]
        offset += 8 + len(y)
        got_decoded = results[offset : offset + len(decoded)]
        offset += len(decoded)
        assert native.LOOPS[level] == levels_wanted(case), name(case)
        assert got_decoded == decoded, f"decoded weight differs: {name(case)}"
        assert got_y == y, f"product differs: {name(case)}"
    assert offset == len(results)


def summed_in_order(case: dict, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y [m, rows] float32 as the portable loop sums it (the order the NEON loop keeps): each product rounded to
    float32, lane t of 8 summing columns 8i + t in turn; a pass over the weight of one token (MAXM = 8 tokens a pass)
    with no scales, or a table per block (up to 4 bits, blocks of whole words), then adds
    ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), any other pass 0 + l0 + l1 + ... + l7; then 0 + that."""
    m, (rows, cols) = x.shape[0], weight.shape
    products = (weight[None] * x[:, None, :]).reshape(m, rows, cols // 8, 8)  # [m, rows, cols / 8, 8]
    lanes = torch.zeros(m, rows, 8)
    for i in range(cols // 8):
        lanes = lanes + products[:, :, i]
    s = lanes.unbind(-1)
    chains = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))
    sequential = torch.zeros(m, rows)
    for t in range(8):
        sequential = sequential + s[t]
    alone = torch.tensor([min(8, m - j // 8 * 8) == 1 for j in range(m)])[:, None]  # [m, 1]: its pass has one token
    block = case["block"]
    one_table = not block or (case["bits"] <= 4 and block % 8 == 0)  # a table per block or none: the chains
    return torch.zeros(m, rows) + torch.where(alone & one_table, chains, sequential)


def test_the_portable_loop_sums_in_its_documented_order(inputs):
    """Here, without qemu: the portable loop's products are `summed_in_order` of its own decoded weight (bit for bit
    the hard assignment's: test_lut_native.py), so the order NEON keeps is written down and checked on every CPU."""
    if native.library() is None:
        pytest.fail(f"the C kernel did not build here: {native.unavailable_reason()}")
    for case, t in inputs[0]:
        y, decoded = portable_here(case, t)
        weight = torch.frombuffer(bytearray(decoded), dtype=case["mode"]).reshape(case["rows"], case["cols"]).float()
        want = summed_in_order(case, weight, t["x"].float()).to(case["y"])
        assert raw(want) == y, name(case)


@pytest.fixture(scope="module")
def inputs():
    every = [(case, tensors(case, seed)) for seed, case in enumerate(cases())]
    return every, b"".join(case_bytes(case, t) for case, t in every)


def test_the_neon_loop_gives_the_portable_loops_bits(arm, inputs):
    every, stdin = inputs
    compare(arm(NEON, stdin), every, lambda case: "neon" if case["neon"] else "portable")


def test_the_portable_loop_gives_the_same_bits_on_aarch64(arm, inputs):
    every, stdin = inputs
    compare(arm(PORTABLE, stdin), every, lambda case: "portable")
