"""The palettized layers of the ONNX export: one `LutMatMul` / `LutGather` node per clustered weight.

ONNX has no lookup-table weight op, so each clustered Linear / Embedding becomes a node of the custom domain
`ai.onnx.contrib` whose definition ships inside the file as a model-local ONNX function written with standard ops
(`function_protos`): a runtime without a kernel for the node inlines that body, which decodes the packed indices
(`Cast`, `Pad`, `Gather`, `Mul`, `Add`, `Div`, `Mod`), reads the table (`Gather`), applies the block scales (`Mul`)
and multiplies (`MatMul`) or looks rows up (`Gather`): bit for bit `_dkm.decode`'s weight, in any ONNX runtime. Its
first op passes the packed bytes through a `Where` on the input's size, so a runtime's constant folding cannot expand
the decode into weight-sized constants at session creation (they would hold more bytes than the dense model).

The node's inputs: `x`, the checkpoint's packed indices as `[n / 8, bits]` bytes, the table as float32 `[G * K, d]`
(a `Cast` of a 16-bit table: a few KiB), `meta` = `[rows, cols, count]`, three decode constants of the bit width,
the row groups' table offsets and, for the `*Scaled` ops, the float32 block scales `[rows, cols / block]`.
onnxruntime with onnxruntime-extensions runs the nodes with our C kernel instead (`_onnx_kernels.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_llmkit.quantization.export._common import PaletteWeight

DOMAIN = "ai.onnx.contrib"  # the domain onnxruntime-extensions serves Python-defined kernels in
INPUTS = ["x", "packed", "lut", "meta", "first_byte", "shift", "kmod", "group_offsets"]


def op_name(gather: bool, scaled: bool) -> str:
    return ("LutGather" if gather else "LutMatMul") + ("Scaled" if scaled else "")


@torch.library.custom_op("llmkit_export::lut", mutates_args=())
def lut(
    x: torch.Tensor,
    packed: torch.Tensor,
    table: torch.Tensor,
    meta: torch.Tensor,
    first_byte: torch.Tensor,
    shift: torch.Tensor,
    kmod: torch.Tensor,
    group_offsets: torch.Tensor,
    scale: torch.Tensor | None,
    gather: bool,
    width: int,
) -> torch.Tensor:
    """`x @ W^T` (or the rows `x` of W with `gather`) of a palettized weight decoded as the ONNX function does;
    `width` is the output's last size (rows, or cols with `gather`)."""
    w = decode(packed, table, meta.tolist(), first_byte, shift, kmod, group_offsets, scale)
    return nn.functional.embedding(x, w) if gather else x @ w.t()


@lut.register_fake
def _(x, packed, table, meta, first_byte, shift, kmod, group_offsets, scale, gather, width):
    shape = (*x.shape, width) if gather else (*x.shape[:-1], width)
    return x.new_empty(shape, dtype=torch.float32)


def decode(packed, table, meta, first_byte, shift, kmod, group_offsets, scale) -> torch.Tensor:
    """The float32 weight `[rows, cols]` by the ONNX function's ops (bit for bit `_dkm.decode`)."""
    rows, cols, count = meta
    z = nn.functional.pad(packed.to(torch.int32), (0, 1))  # [n8, bits + 1]: a zero byte after each group
    pairs = z[:, first_byte] + z[:, first_byte + 1] * 256  # the two bytes holding each index, < 2**16
    idx = torch.remainder(torch.div(pairs, shift, rounding_mode="floor"), kmod).to(torch.int64)
    idx = idx.reshape(-1)[:count].reshape(group_offsets.shape[0], -1) + group_offsets  # [G, n]
    w = table.float()[idx.reshape(-1)].reshape(rows, cols)
    if scale is not None:
        w = (w.reshape(rows, scale.shape[1], -1) * scale.float().unsqueeze(-1)).reshape(rows, cols)
    return w


class OnnxPalettized(nn.Module):
    """A clustered Linear / Embedding as one `lut` op over the compact checkpoint's own tensors."""

    def __init__(self, module: nn.Module, weight: PaletteWeight) -> None:
        super().__init__()
        self.kind, self.shape, self.bits = weight.kind, weight.shape, weight.bits
        b, packed = weight.bits, weight.packed.reshape(-1)
        pad = (-packed.numel()) % b  # bytes up to whole groups of 8 indices (none where rows * cols % 8 == 0)
        if pad:
            packed = torch.cat([packed, packed.new_zeros(pad)])
        self.register_buffer("weight_packed", packed.reshape(-1, b).clone())  # [n8, bits]
        self.register_buffer("weight_lut", weight.lut.reshape(-1, weight.cluster_dim).clone())  # [G * K, d]
        self.register_buffer("weight_scale", None if weight.scale is None else weight.scale.clone())
        self.register_buffer("meta", torch.tensor([*weight.shape, weight.count], dtype=torch.int64))
        # Index p of a group of 8 starts at bit p * bits: in byte p * bits // 8, at bit p * bits % 8 of it.
        starts = [p * b for p in range(8)]
        self.register_buffer("first_byte", torch.tensor([s // 8 for s in starts], dtype=torch.int64))
        self.register_buffer("shift", torch.tensor([1 << (s % 8) for s in starts], dtype=torch.int32))
        self.register_buffer("kmod", torch.tensor(1 << b, dtype=torch.int32))
        offsets = torch.arange(weight.groups, dtype=torch.int64) * (1 << b)
        self.register_buffer("group_offsets", offsets.unsqueeze(-1))  # [G, 1]
        bias = getattr(module, "bias", None) if weight.kind == "linear" else None
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().cpu(), requires_grad=False)

    def tensors(self) -> tuple:
        scale = None if self.weight_scale is None else self.weight_scale.float()
        return (self.weight_packed, self.weight_lut.float(), self.meta, self.first_byte, self.shift, self.kmod,
                self.group_offsets, scale)  # fmt: skip

    def decoded_weight(self) -> torch.Tensor:
        packed, table, meta, *rest = self.tensors()
        return decode(packed, table, meta.tolist(), *rest)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W^T` for an embedding's table too (the LM head tied to it)."""
        return lut(x, *self.tensors(), False, self.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gather = self.kind == "embedding"
        y = lut(x, *self.tensors(), gather, self.shape[1] if gather else self.shape[0])
        return y if self.bias is None else y + self.bias


def translation(x, packed, table, meta, first_byte, shift, kmod, group_offsets, scale, gather, width):
    """torch.onnx's translation of the `lut` op: one node of `DOMAIN` (its function body: `function_protos`)."""
    import onnxscript

    args = [x, packed, table, meta, first_byte, shift, kmod, group_offsets] + ([] if scale is None else [scale])
    name = op_name(gather, scale is not None)
    return onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, 1), name, op_schema=_schema(name))(*args)


def _schema(name: str):
    """The ONNX schema of one op (what the translation needs to emit a node of it)."""
    from onnx.defs import OpSchema

    inputs = INPUTS + (["scale"] if name.endswith("Scaled") else [])
    formal = [OpSchema.FormalParameter(n, f"T{i}") for i, n in enumerate(inputs)]
    any_tensor = ["tensor(float)", "tensor(int64)", "tensor(int32)", "tensor(uint8)"]
    constraints = [(f"T{i}", any_tensor, "") for i in range(len(inputs))] + [("Y", ["tensor(float)"], "")]
    return OpSchema(name, DOMAIN, 1, inputs=formal, outputs=[OpSchema.FormalParameter("y", "Y")],
                    type_constraints=constraints)  # fmt: skip


def function_protos(used: set[str]):
    """The model-local ONNX functions (standard ops, opset 18) defining each op of `used`."""
    return [_function(name) for name in sorted(used)]


def _function(name: str):
    from onnx import TensorProto, helper

    scaled, gather = name.endswith("Scaled"), name.startswith("LutGather")
    nodes = []

    def node(op, inputs, output, **attrs):
        nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output

    def const(out, values, dtype=TensorProto.INT64):
        return node("Constant", [], "k_" + out, value=helper.make_tensor(out, dtype, [len(values)], values))

    # a value of the input (its size > -1: always true) keeps the whole decode out of constant folding
    size = node("Size", ["x"], "size")
    live = node("Greater", [size, node("Constant", [], "minus_one", value_int=-1)], "live")
    packed = node("Where", [live, "packed", "packed"], "packed_live")
    z = node("Cast", [packed], "z", to=TensorProto.INT32)
    z = node("Pad", [z, const("pads", [0, 0, 0, 1])], "z_padded")
    lo = node("Gather", [z, "first_byte"], "lo", axis=1)
    next_byte = node("Add", ["first_byte", const("one", [1])], "next_byte")
    hi = node("Gather", [z, next_byte], "hi", axis=1)
    pairs = node("Add", [lo, node("Mul", [hi, const("c256", [256], TensorProto.INT32)], "hi256")], "pairs")
    idx = node("Mod", [node("Div", [pairs, "shift"], "shifted"), "kmod"], "idx")
    idx = node("Cast", [idx], "idx64", to=TensorProto.INT64)
    flat = node("Reshape", [idx, const("flat", [-1])], "flat")
    count = node("Slice", ["meta", const("two", [2]), const("three", [3])], "count")
    flat = node("Slice", [flat, const("zero", [0]), count], "flat_count")
    groups = node("Slice", [node("Shape", ["group_offsets"], "go_shape"), const("z0", [0]), const("z1", [1])], "g")
    gshape = node("Concat", [groups, const("minus", [-1])], "gshape", axis=0)
    rows_idx = node("Add", [node("Reshape", [flat, gshape], "by_group"), "group_offsets"], "table_rows")
    w = node("Gather", ["lut", node("Reshape", [rows_idx, const("flat2", [-1])], "entries")], "w_vectors", axis=0)
    wshape = node("Slice", ["meta", const("s0", [0]), const("s2", [2])], "wshape")
    w = node("Reshape", [w, wshape], "w")
    if scaled:
        blocks = node("Concat", [node("Shape", ["scale"], "scale_shape"), const("m1", [-1])], "blocks", axis=0)
        spread = node("Unsqueeze", ["scale", const("axis2", [2])], "spread")
        w = node("Mul", [node("Reshape", [w, blocks], "w_blocks"), spread], "w_scaled_blocks")
        w = node("Reshape", [w, wshape], "w_scaled")
    if gather:
        node("Gather", [w, "x"], "y", axis=0)
    else:
        node("MatMul", ["x", node("Transpose", [w], "wt", perm=[1, 0])], "y")
    inputs = INPUTS + (["scale"] if scaled else [])
    return helper.make_function(DOMAIN, name, inputs, ["y"], nodes, [helper.make_opsetid("", 18)])
