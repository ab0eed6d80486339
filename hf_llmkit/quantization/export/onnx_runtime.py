"""onnxruntime kernels for the export's palettized nodes (`_onnx_lut.py`): our C kernel instead of the standard-op
definition, through onnxruntime-extensions' Python custom operators (PyPI `onnxruntime-extensions`).

onnxruntime runs a node of a custom domain with a registered kernel and inlines the model-local function of the
same name otherwise, so one file serves both: `onnxruntime_session(path)` registers the kernels and opens the file
with them; a plain `onnxruntime.InferenceSession(path)` (or any other runtime) decodes with standard ops. The
kernels multiply straight from the packed indices with `_lut_native` (one pass over the packed bytes per call, no
decoded weight kept anywhere) where it serves the layer (tables of scalars, rows of whole bytes; the CPU's best
loops), and decode with the function's own torch ops otherwise. onnxruntime's wheel ships no C headers, so the
kernels are Python functions that onnxruntime-extensions calls: each call copies its inputs (the packed bytes
included) and its output through Python, about 0.1-0.2 ms per node on this project's CPUs, which the speed rows of
`benchmarks/dkm_inference.py` include; the outputs come back as arrays (`hf_llmkit.compat.onnxruntime_extensions`:
the package's own hook turns them into Python lists, which cost more than the product at prefill lengths).

Above `lut_gemv.MAX_FUSED_TOKENS` tokens (`lut_gemv.decodes`: a prompt's prefill), a `LutMatMul` node decodes its
weight with the C kernel into one float32 buffer that every node reuses (one per thread: the decode and the GEMM
release the GIL, so sessions run from several threads, or onnxruntime's parallel executor, must not share it),
`DECODE_CHUNK` weights (whole row groups) at a time, and multiplies each block of rows with one GEMM (torch's): the
packed bytes are read once instead of once per 8 tokens, and the buffer is the only dense memory, a few MiB whatever
the model. The products differ from the
fused kernel's by float32 rounding of the sums (the same decoded weights, another summation order).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import torch

from hf_llmkit.quantization.export import _onnx_lut as lut_op

_REGISTERED = False
DECODE_CHUNK = 1 << 20  # weights decoded at a time above the token threshold: a 4 MiB float32 buffer, reused
_local = threading.local()  # .buffer: this thread's decode buffer


def extensions_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime_extensions") is not None


def _layer(packed, table, meta, groups: int, scale):
    """What `_lut_native` reads of a palettized layer, over these arrays (no copy)."""
    rows, cols, _ = (int(v) for v in meta)
    bits = packed.shape[1]
    return SimpleNamespace(
        weight_packed=torch.from_numpy(packed).reshape(-1),
        weight_lut=torch.from_numpy(table).reshape(groups, -1, table.shape[1]),
        weight_scale=None if scale is None else torch.from_numpy(scale),
        weight_shape=(rows, cols),
        settings=SimpleNamespace(bits=bits, groups=groups, cluster_dim=table.shape[1]),
        count=rows * cols // table.shape[1],
    )


def matmul(x, packed, table, meta, first_byte, shift, kmod, group_offsets, scale=None):
    """`x @ W^T` of a `LutMatMul[Scaled]` node, float32."""
    from hf_llmkit.quantization import _lut_native as native
    from hf_llmkit.quantization import lut_gemv

    rows = int(meta[0])
    layer = _layer(packed, table, meta, group_offsets.shape[0], scale)
    flat = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).reshape(-1, x.shape[-1])
    if native.supports(layer):
        y = (
            _decoded_product(layer, flat)
            if lut_gemv.decodes(flat.shape[0], rows * flat.shape[1], blocked=True)
            else native.gemv(layer, flat, torch.float32)
        )
    else:
        y = flat @ _decoded(packed, table, meta, first_byte, shift, kmod, group_offsets, scale).t()
    return y.reshape(*x.shape[:-1], rows).numpy()


def _decoded_product(layer, flat: torch.Tensor) -> torch.Tensor:
    """`flat @ W^T` `[tokens, rows]`: W decoded by the C kernel a block of rows at a time into this thread's buffer,
    each block multiplied by one GEMM (a layer of one block: straight into the output)."""
    from hf_llmkit.quantization import _lut_native as native

    rows, cols = layer.weight_shape
    blocks = list(_row_blocks(layer))
    y = None if len(blocks) == 1 else torch.empty(flat.shape[0], rows)
    for part, start, stop in blocks:
        buffer = getattr(_local, "buffer", None)
        if buffer is None or buffer.numel() < (stop - start) * cols:
            buffer = _local.buffer = torch.empty((stop - start) * cols)
        w = native.decode(part, torch.float32, out=buffer[: (stop - start) * cols].view(stop - start, cols))
        if y is None:
            return flat @ w.t()
        y[:, start:stop] = flat @ w.t()
    return y


def _row_blocks(layer):
    """(sub-layer, first row, end row) of blocks of whole row groups holding about `DECODE_CHUNK` weights: views of
    the layer's packed bytes (rows of whole bytes), tables and scales, nothing copied."""
    rows, cols = layer.weight_shape
    s = layer.settings
    per_group = rows // s.groups if s.groups > 1 else 1  # one table: any block of rows reads it
    step = max(1, DECODE_CHUNK // cols // per_group) * per_group
    row_bytes = cols * s.bits // 8
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        lut = layer.weight_lut if s.groups == 1 else layer.weight_lut[start // per_group : stop // per_group]
        part = SimpleNamespace(
            weight_packed=layer.weight_packed[start * row_bytes : stop * row_bytes],
            weight_lut=lut,
            weight_scale=None if layer.weight_scale is None else layer.weight_scale[start:stop],
            weight_shape=(stop - start, cols),
            settings=SimpleNamespace(bits=s.bits, groups=lut.shape[0], cluster_dim=1),
            count=(stop - start) * cols,
        )
        yield part, start, stop


def gather(ids, packed, table, meta, first_byte, shift, kmod, group_offsets, scale=None):
    """The rows `ids` of W of a `LutGather[Scaled]` node, float32 (decoding only those rows)."""
    from hf_llmkit.quantization import lut_gemv

    layer = _layer(packed, table, meta, group_offsets.shape[0], scale)
    rows = lut_gemv.decode_rows(layer, torch.from_numpy(np.asarray(ids, dtype=np.int64)))
    return rows.numpy()


def _decoded(packed, table, meta, first_byte, shift, kmod, group_offsets, scale):
    t = torch.from_numpy
    return lut_op.decode(t(packed), t(table), [int(v) for v in meta], t(first_byte), t(shift), t(kmod),
                         t(group_offsets), None if scale is None else t(scale))  # fmt: skip


def register_kernels() -> None:
    """Register the four kernels with onnxruntime-extensions (once per process); an ImportError naming the package
    where it is not installed."""
    global _REGISTERED
    if _REGISTERED:
        return
    try:
        from onnxruntime_extensions import PyCustomOpDef, onnx_op
    except ImportError as error:
        raise ImportError(
            f"the palettized ONNX kernels need onnxruntime-extensions ({error}): pip install onnxruntime-extensions "
            "(or open the file with onnxruntime.InferenceSession: its standard-op definitions decode the weights)."
        ) from error
    from hf_llmkit.compat.onnxruntime_extensions import array_outputs

    array_outputs()
    d = PyCustomOpDef
    common = [d.dt_uint8, d.dt_float, d.dt_int64, d.dt_int64, d.dt_int32, d.dt_int32, d.dt_int64]
    for gathers in (False, True):
        for scaled in (False, True):
            inputs = [d.dt_int64 if gathers else d.dt_float, *common] + ([d.dt_float] if scaled else [])
            name = lut_op.op_name(gathers, scaled)
            fn = gather if gathers else matmul
            onnx_op(op_type=name, domain=lut_op.DOMAIN, inputs=inputs, outputs=[d.dt_float])(fn)
    _REGISTERED = True


def onnxruntime_session(path, options=None, **kwargs):
    """An `onnxruntime.InferenceSession` of an exported file whose palettized nodes run our C kernel
    (`register_kernels`); `options`: the `SessionOptions` to add the kernels to; other arguments go to the session."""
    import onnxruntime

    register_kernels()  # first: names the package where it is missing
    from onnxruntime_extensions import get_library_path

    options = options or onnxruntime.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    return onnxruntime.InferenceSession(str(path), options, **kwargs)


def greedy_generate(session, input_ids, attention_mask=None, *, max_new_tokens: int):
    """Greedy decoding with an exported file's session, its key/value cache carried between calls, as
    transformers' `generate(do_sample=False)` does: `input_ids` / `attention_mask` int64 `[batch, prompt]`
    (left-padded rows: 0 in the mask), positions counted over the real tokens. Returns `[batch, prompt + new]`."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"greedy_generate: max_new_tokens must be an integer >= 0, got {max_new_tokens!r}.")
    if not any(i.name.startswith("past_key_values.") for i in session.get_inputs()):
        raise ValueError(
            "greedy_generate: the file has no key/value cache inputs (an export of an older hf_llmkit): export it "
            "again with export_onnx."
        )
    ids = np.asarray(input_ids, dtype=np.int64)
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(
            f"greedy_generate: input_ids must be [batch, prompt] with at least one row and one token, got shape "
            f"{list(ids.shape)}: pass a prompt of one token or more (e.g. the tokenizer's BOS token)."
        )
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
    if mask.shape != ids.shape:
        raise ValueError(
            f"greedy_generate: attention_mask has shape {list(mask.shape)}, input_ids {list(ids.shape)}: pass one "
            "mask entry per prompt token."
        )
    names = [i.name for i in session.get_inputs()]
    past = {i.name: i for i in session.get_inputs() if i.name.startswith("past_key_values.")}
    feed = {n: np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), np.float32) for n, i in past.items()}
    step, out = ids, [ids]
    for _ in range(max_new_tokens):
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -step.shape[1] :]
        feed.update(input_ids=step, attention_mask=mask, position_ids=positions)
        logits, *present = session.run(None, {n: feed[n] for n in names})
        step = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        out.append(step)
        mask = np.concatenate([mask, np.ones_like(step)], axis=1)
        feed.update(zip([n.replace("present", "past_key_values") for n in _outputs(session)[1:]], present))
    return np.concatenate(out, axis=1)


def _outputs(session) -> list[str]:
    return [o.name for o in session.get_outputs()]
