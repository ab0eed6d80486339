"""`export_coreml`: a DKM causal LM as a stateful Core ML program whose clustered weights are palettized constants.

The program generates on a device token by token: inputs `input_ids` int32 `[batch, length]` and `causal_mask`
float16 `[batch, 1, length, end]` (both lengths flexible up to `seq_len`), output `logits`, and the key/value cache
kept in two float16 states (`keyCache` / `valueCache`, `ct.StateType`, iOS 18+) that each call writes at slots
`end - length .. end - 1` (`_coreml_state.StatefulLM`). The model is converted by `coremltools.convert` from a trace
of a twin that holds the decoded weights (`_common.export_copy`), to a MIL program (`convert_to="milinternal"`);
each decoded weight constant is then replaced by `constexpr_lut_to_dense(indices, lut)` with our own indices and
tables (coremltools' iOS18 op: a table per group of output channels, `[G, 1, K, d]`, vectors along the input
axis), followed by `constexpr_blockwise_shift_scale` with our block scales `[rows, cols / block]` when the model has
them (the pair coremltools' own palettizer emits for its per-channel scales). `precision="float16"` (the default)
computes in float16 and stores tables and scales in float16 (a checkpoint's 16-bit tables and scales at their
size; weights decode to ours rounded to float16, exactly so for float16 tables); `"float32"` computes in float32
with float32 tables, weights bit for bit ours. Conversion runs on Linux; running the package needs macOS.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from hf_llmkit.quantization.export._common import (
    PaletteWeight,
    check_causal_lm,
    check_output,
    dense_module,
    export_copy,
    palettized_weights,
    staging,
)
from hf_llmkit.quantization.export._coreml_state import KEY, VALUE, StatefulLM, causal_mask

PRECISIONS = ("float16", "float32")
MAX_SEQ_LEN = 1 << 16
# Index widths constexpr_lut_to_dense stores; a 5- or 7-bit table is padded to the next one (unused entries).
COREML_INDEX_BITS = (1, 2, 3, 4, 6, 8)
_PREFIX = "m."  # StatefulLM names the model `m`: the converter names each weight constant by its path


def coreml_index_bits(bits: int) -> int:
    """The Core ML index width that holds `bits`-bit indices."""
    return next(b for b in COREML_INDEX_BITS if b >= bits)


def coreml_lut(weight: PaletteWeight, dtype=np.float32) -> np.ndarray:
    """Our table `[G, K, d]` as Core ML's `[G, 1, K', d]` in `dtype` (padded with its last entry to 2**index
    bits)."""
    lut = weight.lut.float()
    pad = (1 << coreml_index_bits(weight.bits)) - lut.shape[1]
    if pad:
        lut = torch.cat([lut, lut[:, -1:].expand(-1, pad, -1)], dim=1)
    return lut.unsqueeze(1).numpy().astype(dtype)


def coreml_indices(weight: PaletteWeight) -> np.ndarray:
    """Our indices as Core ML's `uint<bits>` tensor `[rows, cols / d]`."""
    from coremltools.converters.mil.mil import types

    dtype = types.nptype_from_builtin(types.string_to_builtin(f"uint{coreml_index_bits(weight.bits)}"))
    return weight.indices().numpy().astype(np.uint8).astype(dtype)


def coreml_target(weights: list[PaletteWeight]):
    """iOS18 (macOS 15), or iOS26 (macOS 26) for block scales: before iOS26 coremltools reorders a table followed by
    a scale into a scaled table per block of each row (`canonicalize_quantized_lut_pattern`, a runtime issue fixed in
    iOS26): a float table entry per 4 weights at 16 entries and 64 inputs per scale, more than the indices cost."""
    import coremltools as ct

    return ct.target.iOS26 if any(w.scale is not None for w in weights) else ct.target.iOS18


def check_coreml_options(path: Path, seq_len: int, batch_size: int, precision: str = "float16") -> None:
    """A ValueError, before any work, for an option or output `export_coreml` refuses."""
    if precision not in PRECISIONS:
        raise ValueError(f"export_coreml: precision must be one of {PRECISIONS}, got {precision!r}.")
    for name, value, top in (("seq_len", seq_len, MAX_SEQ_LEN), ("batch_size", batch_size, 1024)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise ValueError(f"export_coreml: {name} must be an integer in [1, {top}], got {value!r}.")
    if path.suffix != ".mlpackage":
        raise ValueError(f"export_coreml: path must end in .mlpackage (an ML program package), got {str(path)!r}.")
    check_output(path, "export_coreml", kind="package")


def export_coreml(
    model: nn.Module,
    path: str | Path,
    *,
    seq_len: int = 512,
    batch_size: int = 1,
    precision: str = "float16",
) -> Path:
    """Write `model` (a DKM causal LM: a reloaded compact checkpoint or a live DKM model) to the Core ML package
    `path` (`.mlpackage`): a stateful program (module docstring) of `batch_size` rows and up to `seq_len` tokens of
    context, computing in `precision`; every clustered weight stored as its packed indices and lookup table
    (`constexpr_lut_to_dense`) and, with `scale_block_size`, its block scales (`constexpr_blockwise_shift_scale`).
    Deployment target: iOS18 / macOS 15, iOS26 / macOS 26 with block scales (`coreml_target`). Nothing is written
    under `path` until the package is complete. Returns the package's path."""
    check_causal_lm(model, "export_coreml")
    path = Path(path)
    check_coreml_options(path, seq_len, batch_size, precision)
    weights = palettized_weights(model, caller="export_coreml")

    import coremltools as ct

    from hf_llmkit.compat.coremltools import fix_scalar_casts

    fix_scalar_casts()
    stateful = stateful_model(model, weights, seq_len=seq_len, batch_size=batch_size)
    layers, _, heads, _, head_dim = stateful.keyCache.shape
    length = min(4, seq_len)
    ids = torch.zeros(batch_size, length, dtype=torch.long)
    mask = causal_mask(length).expand(batch_size, -1, -1, -1)
    with torch.no_grad():
        traced = torch.jit.trace(stateful.eval(), (ids, mask), strict=False)
    tokens, end = ct.RangeDim(1, seq_len, default=length), ct.RangeDim(1, seq_len, default=length)
    cache = (layers, batch_size, heads, seq_len, head_dim)
    options = dict(minimum_deployment_target=coreml_target(weights))
    program = ct.convert(
        traced,
        inputs=[
            ct.TensorType(name="input_ids", shape=(batch_size, tokens), dtype=np.int32),
            ct.TensorType(name="causal_mask", shape=(batch_size, 1, tokens, end), dtype=np.float16),
        ],
        outputs=[ct.TensorType(name="logits")],
        states=[ct.StateType(ct.TensorType(shape=cache, dtype=np.float16), name=n) for n in (KEY, VALUE)],
        convert_to="milinternal",
        compute_precision=ct.precision.FLOAT32,  # the decoded weights stay float32 constants, found by value below
        **options,
    )
    half = precision == "float16"
    _palettize(program, weights, half=half)
    compute = ct.precision.FLOAT16 if half else ct.precision.FLOAT32
    package = ct.convert(program, convert_to="mlprogram", skip_model_load=True, compute_precision=compute, **options)
    with staging(path, folder=False) as tmp:
        package.save(str(tmp / path.name))
    return path


def stateful_model(model: nn.Module, weights: list[PaletteWeight], *, seq_len: int, batch_size: int) -> StatefulLM:
    """The module `export_coreml` traces: a float32 twin of `model` with the decoded weights and its cache in float16
    buffers (`_coreml_state.StatefulLM`)."""
    from hf_llmkit.quantization.export.onnx import cache_shapes

    layers, heads, head_dim = cache_shapes(model.config)
    twin = export_copy(model, weights, dense_module).m
    return StatefulLM(twin, batch_size=batch_size, max_len=seq_len, layers=layers, heads=heads, head_dim=head_dim)


def _palettize(program, weights: list[PaletteWeight], *, half: bool) -> None:
    """Replace each decoded weight constant of `program` by the lookups of its palettized weight (tables and scales
    in float16 with `half`, followed by a cast to the float32 the program computes in until its float16 pass)."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.scope import ScopeInfo

    dtype = np.float16 if half else np.float32
    function = program.functions["main"]
    consts = {op.name: op for op in function.operations if op.op_type == "const"}
    for weight in weights:
        op = consts.get(_PREFIX + weight.name + ".weight")
        if op is None or not np.array_equal(op.outputs[0].val, weight.decoded().numpy()):
            raise RuntimeError(f"export_coreml: the converted program has no constant for {weight.name}.weight")
        scopes = [ScopeInfo(source=source, data=data) for source, data in op.scopes.items()]
        with function, mb.scope(*scopes):  # the scopes of the constant it replaces (the frontend requires them)
            name = weight.name.replace(".", "_")
            new = mb.constexpr_lut_to_dense(
                indices=coreml_indices(weight),
                lut=coreml_lut(weight, dtype),
                vector_axis=np.int32(1) if weight.cluster_dim > 1 else None,
                before_op=op,
                name=name + "_palettized",
            )
            if weight.scale is not None:
                new = mb.constexpr_blockwise_shift_scale(
                    data=new, scale=weight.scale.float().numpy().astype(dtype), before_op=op, name=name + "_scales"
                )
            if half:
                new = mb.cast(x=new, dtype="fp32", before_op=op, name=name + "_to_fp32")
            op.enclosing_block.replace_uses_of_var_after_op(
                anchor_op=op, old_var=op.outputs[0], new_var=new, force_replace=True
            )
            op.enclosing_block.remove_ops([op])
