"""`export_coreml`: a DKM causal LM as a Core ML program whose clustered weights are palettized constants.

The model is converted by `coremltools.convert` from a trace of a float32 twin that holds the decoded weights
(`_common.export_copy`), to a MIL program (`convert_to="milinternal"`); each decoded weight constant is then replaced
by `constexpr_lut_to_dense(indices, lut)` with our own indices and tables (coremltools' iOS18 op: a table per group
of output channels, `[G, 1, K, d]`, vectors along the input axis), followed by `constexpr_blockwise_shift_scale`
with our block scales `[rows, cols / block]` when the model has them (the pair coremltools' own palettizer emits for
its per-channel scales). The program is saved as an `.mlpackage` (iOS18 / macOS15 target). Conversion runs on
Linux; running the package needs macOS.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from hf_llmkit.quantization.export._common import (
    PaletteWeight,
    check_causal_lm,
    dense_module,
    export_copy,
    palettized_weights,
)

PRECISIONS = ("float32",)
# Index widths constexpr_lut_to_dense stores; a 5- or 7-bit table is padded to the next one (unused entries).
COREML_INDEX_BITS = (1, 2, 3, 4, 6, 8)
_PREFIX = "m."  # CausalLogits names the model `m`: the converter names each weight constant by its path


def coreml_index_bits(bits: int) -> int:
    """The Core ML index width that holds `bits`-bit indices."""
    return next(b for b in COREML_INDEX_BITS if b >= bits)


def coreml_lut(weight: PaletteWeight) -> np.ndarray:
    """Our table `[G, K, d]` as Core ML's `[G, 1, K', d]` (float32; padded with its last entry to 2**index bits)."""
    lut = weight.lut.float()
    pad = (1 << coreml_index_bits(weight.bits)) - lut.shape[1]
    if pad:
        lut = torch.cat([lut, lut[:, -1:].expand(-1, pad, -1)], dim=1)
    return lut.unsqueeze(1).numpy()


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


def export_coreml(
    model: nn.Module,
    path: str | Path,
    *,
    seq_len: int = 64,
    batch_size: int = 1,
    precision: str = "float32",
) -> Path:
    """Write `model` (a DKM causal LM: a reloaded compact checkpoint or a live DKM model) to the Core ML package
    `path` (`.mlpackage`): input `input_ids` int32 `[batch_size, seq_len]`, output `logits`; every clustered weight is
    stored as its packed indices and lookup table (`constexpr_lut_to_dense`) and, with `scale_block_size`, its block
    scales (`constexpr_blockwise_shift_scale`), decoding to exactly our weights. Deployment target: iOS18 / macOS 15,
    iOS26 / macOS 26 with block scales (`coreml_target`). Returns the package's path."""
    check_causal_lm(model, "export_coreml")
    if precision not in PRECISIONS:
        raise ValueError(
            f"export_coreml: precision must be one of {PRECISIONS} (the program computes in float32, the "
            f"weights decode to ours bit for bit), got {precision!r}; leave it unset."
        )
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"export_coreml: {name} must be a positive integer, got {value!r}.")
    path = Path(path)
    if path.suffix != ".mlpackage":
        raise ValueError(f"export_coreml: path must end in .mlpackage (an ML program package), got {str(path)!r}.")
    weights = palettized_weights(model, caller="export_coreml")

    import coremltools as ct

    from hf_llmkit.compat.coremltools import fix_scalar_casts

    fix_scalar_casts()
    wrapper = export_copy(model, weights, dense_module)
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    with torch.no_grad():
        traced = torch.jit.trace(wrapper, (ids,), strict=False)
    options = dict(minimum_deployment_target=coreml_target(weights), compute_precision=ct.precision.FLOAT32)
    inputs = [ct.TensorType(name="input_ids", shape=(batch_size, seq_len), dtype=np.int32)]
    program = ct.convert(
        traced, inputs=inputs, outputs=[ct.TensorType(name="logits")], convert_to="milinternal", **options
    )
    _palettize(program, weights)
    package = ct.convert(program, convert_to="mlprogram", skip_model_load=True, **options)
    package.save(str(path))
    return path


def _palettize(program, weights: list[PaletteWeight]) -> None:
    """Replace each decoded weight constant of `program` by the lookups of its palettized weight."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.scope import ScopeInfo

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
                lut=coreml_lut(weight),
                vector_axis=np.int32(1) if weight.cluster_dim > 1 else None,
                before_op=op,
                name=name + "_palettized",
            )
            if weight.scale is not None:
                new = mb.constexpr_blockwise_shift_scale(
                    data=new, scale=weight.scale.float().numpy(), before_op=op, name=name + "_block_scales"
                )
            op.enclosing_block.replace_uses_of_var_after_op(
                anchor_op=op, old_var=op.outputs[0], new_var=new, force_replace=True
            )
            op.enclosing_block.remove_ops([op])
