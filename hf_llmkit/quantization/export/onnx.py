"""`export_onnx`: a DKM causal LM as one ONNX file that keeps the packed indices, tables and block scales as
initializers and decodes them with standard ops, run by any ONNX runtime.

ONNX has no lookup-table weight op, so each clustered layer is swapped, on a copy, for `OnnxPalettized`, whose
weight is computed in the graph from the compact checkpoint's own tensors: `bits` bytes hold 8 indices
(little-endian bit stream, `_packing`), each read from the two bytes that hold it (`Gather`, `Mul`, `Add`, `Div`,
`Mod`); `Gather` reads the table (one table per group of rows, offset by `g * K`) and `Mul` applies the block
scales. The decoded weight is bit for bit `_dkm.decode`'s. Exported with `torch.onnx.export` (the dynamo exporter,
no graph optimisation, so no decode is folded into a dense constant); optimum's exporter (the `optimum-onnx`
package, 0.1.0) needs transformers < 4.58 and optimum 2.1, so it cannot install beside ours.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hf_llmkit.quantization.export._common import PaletteWeight, check_causal_lm, export_copy, palettized_weights

OPSET = 18


class OnnxPalettized(nn.Module):
    """A clustered Linear / Embedding whose weight is decoded from its packed indices with standard ONNX ops."""

    def __init__(self, module: nn.Module, weight: PaletteWeight) -> None:
        super().__init__()
        self.kind, self.shape, self.bits = weight.kind, weight.shape, weight.bits
        self.count, k, b = weight.count, 1 << weight.bits, weight.bits
        self.register_buffer("weight_packed", weight.packed.clone())
        self.register_buffer("weight_lut", weight.lut.reshape(-1, weight.cluster_dim).clone())  # [G * K, d]
        self.register_buffer("weight_scale", None if weight.scale is None else weight.scale.clone())
        self.pad = (-weight.packed.numel()) % b  # bytes up to whole groups of 8 indices
        # Index p of a group of 8 starts at bit p * bits: in byte p * bits // 8, at bit p * bits % 8 of it.
        starts = [p * b for p in range(8)]
        self.register_buffer("first_byte", torch.tensor([s // 8 for s in starts], dtype=torch.int64))
        self.register_buffer("shift", torch.tensor([1 << (s % 8) for s in starts], dtype=torch.int32))
        groups = weight.groups
        self.register_buffer("group_offsets", (torch.arange(groups, dtype=torch.int64) * k).unsqueeze(-1))
        self.k, self.groups, self.cluster_dim = k, groups, weight.cluster_dim
        bias = getattr(module, "bias", None) if weight.kind == "linear" else None
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().cpu(), requires_grad=False)

    def decoded_weight(self) -> torch.Tensor:
        packed = self.weight_packed
        if self.pad:
            packed = torch.cat([packed, packed.new_zeros(self.pad)])
        # [n8, bits + 1] bytes (a zero byte after each group) -> the two bytes holding each index -> [n8, 8] indices;
        # every value stays below 2**16, exact in any integer or float arithmetic a runtime uses
        groups = packed.reshape(-1, self.bits).to(torch.int32)
        groups = torch.cat([groups, groups.new_zeros(groups.shape[0], 1)], dim=1)
        pairs = groups[:, self.first_byte] + groups[:, self.first_byte + 1] * 256
        idx = torch.remainder(torch.div(pairs, self.shift, rounding_mode="floor"), self.k).to(torch.int64)
        idx = idx.reshape(-1)[: self.count].reshape(self.groups, -1) + self.group_offsets  # [G, n]
        w = F.embedding(idx.reshape(-1), self.weight_lut.float())  # Gather: [G * n, d]
        w = w.reshape(self.shape)
        if self.weight_scale is not None:
            rows, blocks = self.weight_scale.shape
            spread = self.weight_scale.float().unsqueeze(-1).expand(rows, blocks, self.shape[1] // blocks)
            w = w * spread.reshape(self.shape)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "embedding":
            return F.embedding(x, self.decoded_weight())
        return F.linear(x, self.decoded_weight(), self.bias)


def export_onnx(model: nn.Module, path: str | Path, *, opset: int = OPSET) -> Path:
    """Write `model` (a DKM causal LM: a reloaded compact checkpoint or a live DKM model) to the ONNX file `path`:
    input `input_ids` int64 `[batch, sequence]` (unpadded; both dynamic), output `logits`; clustered weights kept as
    packed indices + tables (+ block scales) decoded in the graph, everything else as in the model (float32).
    Returns the file's path."""
    check_causal_lm(model, "export_onnx")
    path = Path(path)
    if path.suffix != ".onnx":
        raise ValueError(f"export_onnx: path must end in .onnx, got {str(path)!r}.")
    if isinstance(opset, bool) or not isinstance(opset, int) or opset < OPSET:
        raise ValueError(f"export_onnx: opset must be an integer >= {OPSET}, got {opset!r}.")
    weights = palettized_weights(model, caller="export_onnx")
    wrapper = export_copy(model, weights, OnnxPalettized)
    ids = torch.zeros(2, 8, dtype=torch.long)
    batch, seq = torch.export.Dim("batch", max=1024), torch.export.Dim("sequence", max=1 << 16)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        program = torch.onnx.export(
            wrapper,
            (ids,),
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_shapes={"input_ids": {0: batch, 1: seq}},
            opset_version=opset,
            dynamo=True,
            optimize=False,
            verbose=False,
        )
    import onnx

    proto = program.model_proto
    for node in proto.graph.node:  # the exporter's per-node provenance (stack traces...): 10x the tiny model's weights
        del node.metadata_props[:]
    onnx.save_model(proto, str(path))
    return path
