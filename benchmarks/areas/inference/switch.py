"""Part `loops` of benchmarks/dkm_inference.py, its prefill switch: from how many tokens a packed layer's product is
faster decoded (the weight decoded by the C kernel, one GEMM) than fused (the C kernel's LUT-GEMV, which reads the
weight once per 8 tokens), per layer shape and compute dtype, and whether `lut_gemv.MAX_FUSED_TOKENS` (the switch
both the PyTorch layers and the ONNX export's kernels take: `lut_gemv.decodes`) picks the faster path.

Per shape (the issue's Llama: attention 1,024 x 1,024, MLP 2,816 x 1,024 and 1,024 x 2,816, head 4,096 x 1,024;
SmolLM2-135M: 576 x 576, 192 x 576, MLP 1,536 x 576 and 576 x 1,536, the tied head 49,152 x 576), 3-bit weights
with bf16 tables and block scales per 64 columns, and token counts from 1 to 128, three paths are timed in
interleaved rounds in one process, one thread: `fused` (`_lut_native.gemv`), `decoded` (`F.linear` of
`_lut_native.decode`'s weight: the PyTorch layers above the switch) in bfloat16 and float32, and `decoded, ONNX`
(float32: `export.onnx_runtime._decoded_product`, a block of rows at a time through the reused buffer). Per shape,
dtype and decoded path the crossover is the fewest tokens from which the decoded path is at least as fast at every
larger count measured; the verdict: the switch's choice costs at most `MAX_LOSS` over the faster path at every shape,
dtype and count (medians), and the threshold that would cost least (`best`).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from harness.common import Bench, markdown_table
from harness.slices import mark

SHAPES = {
    "issue attention": (1024, 1024),
    "issue MLP up": (2816, 1024),
    "issue MLP down": (1024, 2816),
    "issue head": (4096, 1024),
    "SmolLM2 attention": (576, 576),
    "SmolLM2 key/value": (192, 576),
    "SmolLM2 MLP up": (1536, 576),
    "SmolLM2 MLP down": (576, 1536),
    "SmolLM2 head": (49152, 576),
}
QUICK_SHAPES = {"tiny MLP up": (384, 128), "tiny MLP down": (128, 384)}
TOKENS = (1, 2, 4, 8, 12, 16, 24, 32, 64, 128)
QUICK_TOKENS = (1, 8, 16)
MAX_LOSS = 1.10  # the switch's path may take at most 10% longer than the faster one
PATHS = {"bfloat16": ("decoded",), "float32": ("decoded", "decoded, ONNX")}


def packed_layers(bits: int, block: int, count: int, rows: int, cols: int):
    """`count` packed layers with random indices, tables and scales (the kernel's speed does not depend on them)."""
    from hf_llmkit.quantization import DKMSettings, PalettizedLinear

    settings = DKMSettings.build(rows, bits=bits, scale_block_size=block, lut_dtype="bfloat16")
    layers = []
    generator = torch.Generator().manual_seed(bits)
    for _ in range(count):
        layer = PalettizedLinear(cols, rows, False, settings)
        layer.weight_packed.copy_(torch.randint(0, 256, layer.weight_packed.shape, generator=generator))
        layer.weight_lut.copy_(torch.randn(layer.weight_lut.shape, generator=generator))
        if layer.weight_scale is not None:
            layer.weight_scale.copy_(torch.rand(layer.weight_scale.shape, generator=generator) + 0.5)
        layers.append(layer.eval())
    return layers


def switch_table(quick: bool) -> dict:
    """Median seconds per shape, dtype, path and token count; crossovers; the verdict's inputs."""
    from hf_llmkit.quantization import _lut_native as native
    from hf_llmkit.quantization import lut_gemv
    from hf_llmkit.quantization.export.onnx_runtime import _decoded_product

    torch.set_num_threads(1)
    shapes, tokens = (QUICK_SHAPES, QUICK_TOKENS) if quick else (SHAPES, TOKENS)
    variants = {}
    for shape, (rows, cols) in shapes.items():
        (layer,) = packed_layers(3, 64, 1, rows, cols)
        for dtype_name, paths in PATHS.items():
            dtype = getattr(torch, dtype_name)
            for count in tokens:
                x = torch.randn(count, cols).to(dtype)
                key = f"{shape}|{dtype_name}|{count}"
                variants[f"{key}|fused"] = lambda layer=layer, x=x, dtype=dtype: native.gemv(layer, x, dtype, dtype)
                variants[f"{key}|decoded"] = lambda layer=layer, x=x, dtype=dtype: F.linear(
                    x, native.decode(layer, dtype)
                )
                if "decoded, ONNX" in paths:
                    variants[f"{key}|decoded, ONNX"] = lambda layer=layer, x=x: _decoded_product(layer, x)
    with torch.inference_mode():
        timings = Bench(rounds=1 if quick else 5, warmup=1).run(variants)
    seconds = {name: statistics.median(values) for name, values in timings.seconds.items()}
    table = {"shapes": {k: list(v) for k, v in shapes.items()}, "tokens": list(tokens), "bits": 3, "block": 64}
    table["max_fused_tokens"] = lut_gemv.MAX_FUSED_TOKENS
    table["seconds"] = seconds
    return table


def _median(table: dict, shape: str, dtype: str, count: int, path: str) -> float:
    return table["seconds"][f"{shape}|{dtype}|{count}|{path}"]


def crossover(table: dict, shape: str, dtype: str, path: str) -> int | None:
    """The fewest tokens from which `path` is at least as fast as fused at every larger count measured (None:
    not at the largest)."""
    best = None
    for count in reversed(table["tokens"]):
        if _median(table, shape, dtype, count, path) > _median(table, shape, dtype, count, "fused"):
            break
        best = count
    return best


def worst_loss(table: dict, threshold: int | None) -> tuple[float, str]:
    """The largest ratio of the switch's path over the faster one, over shapes, dtypes, decoded paths and counts, if
    the switch decoded above `threshold` tokens (None: as `lut_gemv.decodes` does, by the weight's size); and where."""
    from hf_llmkit.quantization import lut_gemv

    worst, where = 1.0, ""
    for shape, (rows, cols) in table["shapes"].items():
        for dtype, paths in PATHS.items():
            for path in paths:
                for count in table["tokens"]:
                    fused, decoded = (_median(table, shape, dtype, count, p) for p in ("fused", path))
                    blocked = path == "decoded, ONNX"  # the ONNX kernels decode a block of rows at a time
                    decode = lut_gemv.decodes(count, rows * cols, blocked) if threshold is None else count > threshold
                    taken = decoded if decode else fused
                    if taken / min(fused, decoded) > worst:
                        worst, where = taken / min(fused, decoded), f"{shape} {dtype} {path} at {count} tokens"
    return worst, where


def verdicts(table: dict | None) -> list[str]:
    """The switch's verdict (none where the table is missing or measured on a loaded machine)."""
    if not table or "seconds" not in table:
        return []
    where = "[prefill switch]"
    if table.get("loaded"):
        return [f"{where} no verdict: measured on a loaded machine"]
    from hf_llmkit.quantization import lut_gemv

    loss, at = worst_loss(table, None)
    best = min([0, *table["tokens"]], key=lambda t: worst_loss(table, t)[0])
    best_loss = worst_loss(table, best)[0]
    rule = (f"fused up to {lut_gemv.MAX_FUSED_TOKENS} tokens ({lut_gemv.MAX_FUSED_TOKENS_LARGE} for weights of "
            f"{lut_gemv.LARGE_WEIGHTS / 2**20:g}M entries or more decoded whole)")  # fmt: skip
    return [
        f"{where} {rule}: at most {loss:.2f}x the faster path ({'holds' if loss <= MAX_LOSS else 'FAILS'} <= "
        f"{MAX_LOSS}; worst: {at}); one threshold for every size would cost least at {best} tokens "
        f"({best_loss:.2f}x at worst)"
    ]


def switch_rows(table: dict | None) -> str:
    """The prefill switch's paragraph and table for the docs ('' where it was not measured)."""
    if not table or "seconds" not in table:
        return ""
    return (
        f"\n\nThe prefill switch (`lut_gemv.decodes`): {table['bits']}-bit packed layers with block scales per "
        f"{table['block']} columns, fused (the C kernel's LUT-GEMV) against decoded (the weight decoded, one GEMM), "
        "medians of interleaved rounds in one process, 1 thread; from how many tokens each decoded path is at least "
        "as fast at every larger count:\n\n" + rows(table)
    )


def rows(table: dict) -> str:
    """Per shape and dtype: the fused and decoded milliseconds at the largest count, and each crossover."""
    largest = table["tokens"][-1]
    out = [[mark("layer, dtype", table), f"fused ms ({largest} tokens)", "decoded ms", "decoded from (tokens)",
            "decoded, ONNX ms", "decoded, ONNX from (tokens)"]]  # fmt: skip
    for shape, (r, c) in table["shapes"].items():
        for dtype, paths in PATHS.items():
            cells = [f"{shape} {r:,} x {c:,}, {dtype}", f"{_median(table, shape, dtype, largest, 'fused') * 1e3:.2f}"]
            for path in ("decoded", "decoded, ONNX"):
                if path not in paths:
                    cells += ["", ""]
                    continue
                cross = crossover(table, shape, dtype, path)
                seconds = _median(table, shape, dtype, largest, path)
                cells += [f"{seconds * 1e3:.2f}", "never" if cross is None else str(cross)]
            out.append(cells)
    return markdown_table(out)
