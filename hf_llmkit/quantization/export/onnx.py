"""`export_onnx`: a DKM causal LM as an ONNX decoder with a key/value cache, in the layout optimum's
`ORTModelForCausalLM` generates from, keeping the packed indices, tables and block scales as initializers.

Inputs: `input_ids` `[batch, sequence]`, `attention_mask` `[batch, past + sequence]` (1 for real tokens, 0 for
padding: left-padded batches generate like their unpadded rows), `position_ids` `[batch, sequence]` and
`past_key_values.{i}.key` / `.value` `[batch, kv_heads, past, head_dim]` (past = 0 on the first call); outputs
`logits` `[batch, sequence, vocab]` and `present.{i}.key` / `.value` `[batch, kv_heads, past + sequence, head_dim]`.
Every size is dynamic. Each clustered layer is one `LutMatMul` / `LutGather` node whose standard-op definition ships
in the file (`_onnx_lut.py`: any ONNX runtime decodes it bit for bit to our weights), and which onnxruntime with
onnxruntime-extensions runs with our C kernel (`_onnx_kernels.py`). Exported with `torch.onnx.export` (the dynamo
exporter, no graph optimisation). Tensors go to an external data file beside the model when they pass
`EXTERNAL_DATA_ABOVE` bytes (protobuf cannot hold 2 GiB). optimum's own exporter (the `optimum-onnx` release on the
registry) needs transformers < 4.58, so it cannot run beside ours; its runtime class loads our folders.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from hf_llmkit.quantization.export import _onnx_lut as lut_op
from hf_llmkit.quantization.export._common import (
    check_causal_lm,
    check_output,
    dense_module,
    export_copy,
    palettized_weights,
    staging,
)

OPSET = 18
MODEL_FILE = "model.onnx"  # the name optimum's ORTModelForCausalLM looks for in a folder
EXTERNAL_DATA_ABOVE = 1 << 30  # bytes of tensors above which they go to `<file>.data` (protobuf's limit is 2 GiB)


class CausalLMWithCache(nn.Module):
    """`(input_ids, attention_mask, position_ids, *past) -> (logits, *present)` of a transformers causal LM, past and
    present as `key, value` per layer (what the export traces)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        seq, total = input_ids.shape[1], attention_mask.shape[1]
        query_at = torch.arange(seq, device=input_ids.device) + (total - seq)  # [S]: each query's slot
        causal = torch.arange(total, device=input_ids.device)[None, :] <= query_at[:, None]  # [S, T]
        allowed = causal[None, None] & attention_mask[:, None, None, :].bool()  # [B, 1, S, T]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        cache = DynamicCache(ddp_cache_data=list(zip(past[0::2], past[1::2])))
        out = self.m(
            input_ids=input_ids,
            attention_mask=mask,  # 4-D: transformers passes it to the attention as it is
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
        )
        return (out.logits, *[t for layer in cache.layers for t in (layer.keys, layer.values)])


def cache_shapes(config) -> tuple[int, int, int]:
    """(layers, key/value heads, head size) of the cache of a transformers decoder config."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads, head_dim


def io_names(layers: int) -> tuple[list[str], list[str]]:
    kv = [f"{{}}.{i}.{t}" for i in range(layers) for t in ("key", "value")]
    inputs = ["input_ids", "attention_mask", "position_ids"] + [n.format("past_key_values") for n in kv]
    return inputs, ["logits"] + [n.format("present") for n in kv]


def export_onnx(
    model: nn.Module,
    path: str | Path,
    *,
    opset: int = OPSET,
    external_data: bool | None = None,
    dense: bool = False,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write `model` (a DKM causal LM: a reloaded compact checkpoint or a live DKM model) as an ONNX decoder with a
    key/value cache (module docstring). `path` ending in `.onnx`: that file (and `<path>.data` with external data);
    any other path: a new folder holding `model.onnx`, `config.json` and `generation_config.json`, which optimum's
    `ORTModelForCausalLM.from_pretrained(path)` generates from. `external_data`: None decides by size
    (`EXTERNAL_DATA_ABOVE`). `dense`: store the decoded float32 weights instead (8-10x the bytes; what a runtime
    without our kernels serves fastest). `tokenizer_from`: a checkpoint folder whose tokenizer files the output
    folder gets too (what generating from it needs). Nothing is written until the export succeeded. Returns the
    output's path."""
    check_causal_lm(model, "export_onnx")
    path = Path(path)
    if isinstance(opset, bool) or not isinstance(opset, int) or opset < OPSET:
        raise ValueError(f"export_onnx: opset must be an integer >= {OPSET}, got {opset!r}.")
    for name, value in (("external_data", external_data), ("dense", dense)):
        if not (isinstance(value, bool) or (value is None and name == "external_data")):
            raise ValueError(f"export_onnx: {name} must be True or False, got {value!r}.")
    check_onnx_target(path)
    check_output(path, "export_onnx", kind="file" if path.suffix == ".onnx" else "folder")
    weights = palettized_weights(model, caller="export_onnx")
    layers, kv_heads, head_dim = cache_shapes(model.config)
    wrapper = CausalLMWithCache(export_copy(model, weights, dense_module if dense else lut_op.OnnxPalettized).m).eval()
    batch, past, seq = 2, 3, 4
    args = (
        torch.ones(batch, seq, dtype=torch.long),
        torch.ones(batch, past + seq, dtype=torch.long),
        torch.arange(past, past + seq).repeat(batch, 1),
        *[torch.zeros(batch, kv_heads, past, head_dim) for _ in range(2 * layers)],
    )
    b, s = torch.export.Dim("batch", max=4096), torch.export.Dim("sequence", max=1 << 20)
    p, t = torch.export.Dim("past", min=0, max=1 << 20), torch.export.Dim("total", max=1 << 21)
    dynamic = ({0: b, 1: s}, {0: b, 1: t}, {0: b, 1: s}, ({0: b, 2: p},) * (2 * layers))  # *past: one entry
    inputs, outputs = io_names(layers)
    with torch.no_grad():
        program = torch.onnx.export(
            wrapper,
            args,
            input_names=inputs,
            output_names=outputs,
            dynamic_shapes=dynamic,
            opset_version=opset,
            custom_translation_table={torch.ops.llmkit_export.lut.default: lut_op.translation},
            dynamo=True,
            optimize=False,
            verbose=False,
        )
    _finish(program.model)
    if external_data is None:
        external_data = sum(v.const_value.nbytes for v in program.model.graph.initializers.values()) > (
            EXTERNAL_DATA_ABOVE
        )
    folder = path.suffix != ".onnx"
    with staging(path, folder=folder) as tmp:
        name = MODEL_FILE if folder else path.name
        _save(program.model, tmp / name, external_data)
        if folder:
            model.config.to_json_file(tmp / "config.json")
            _generation_config(model, tmp)
            if tokenizer_from is not None:
                copy_tokenizer(Path(tokenizer_from), tmp)
    return path


def check_onnx_target(path: Path) -> None:
    """A ValueError before any work for an output the export cannot write as a whole (see `staging`)."""
    if path.suffix not in (".onnx", ""):
        raise ValueError(f"export_onnx: path must be an .onnx file or a new folder (no suffix), got {str(path)!r}.")


def _finish(model) -> None:
    """Drop the exporter's per-node provenance (10x a tiny model's weights) and add the palettized ops' functions."""
    import onnx_ir as ir

    used = set()
    for node in model.graph.all_nodes():
        node.metadata_props.clear()
        if node.domain == lut_op.DOMAIN:
            used.add(node.op_type)
    model.opset_imports[lut_op.DOMAIN] = 1
    for proto in lut_op.function_protos(used):
        function = ir.serde.deserialize_function(proto)
        model.functions[function.identifier()] = function


def _save(model, file: Path, external_data: bool) -> None:
    import onnx_ir as ir

    if external_data:
        ir.save(model, file, external_data=file.name + ".data")
    else:
        ir.save(model, file)


def _generation_config(model: nn.Module, folder: Path) -> None:
    config = getattr(model, "generation_config", None)
    if config is not None:
        config.to_json_file(folder / "generation_config.json")
    text = json.loads((folder / "config.json").read_text())
    text.pop("quantization_config", None)  # the ONNX file holds the palettized layers; no loader must requantize
    text["use_cache"] = True
    (folder / "config.json").write_text(json.dumps(text, indent=2, sort_keys=True) + "\n")


def copy_tokenizer(checkpoint: Path, folder: Path) -> None:
    """Copy a checkpoint's tokenizer files into an exported folder (what `generate` needs beside the model)."""
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "chat_template.jinja",
    ):
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, folder / name)
