"""`export_coreml`: the Core ML program's palettized weights decode bit for bit to ours (read back from the saved
package through coremltools), for tables per tensor and per grouped channel, 3 to 5 bits, vectors, embeddings and
block scales, in float32 and (rounded to float16, 16-bit tables and scales kept at 16 bits) float16; the program is
stateful (a float16 key/value cache as Core ML states, flexible lengths) and the module it is traced from generates
our tokens; bad input is one ValueError before any work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import export_coreml, quantize_model
from hf_llmkit.quantization.export import palettized_weights
from hf_llmkit.testing import tiny_llama

ct = pytest.importorskip("coremltools", reason="Core ML export needs coremltools (the `export` extra)")

CASES = {
    "3bit-per-tensor-reloaded": (DKMConfig(bits=3), True),
    "4bit-per-grouped-channel-fp16": (
        DKMConfig(bits=4, granularity="per_grouped_channel", group_size=16, lut_dtype="float16"),
        False,
    ),
    "3bit-block-scales-reloaded": (DKMConfig(bits=3, scale_block_size=16, lut_dtype="float16"), True),
    "5bit-vectors-embeddings": (DKMConfig(bits=5, cluster_dim=2, quantize_embeddings=True, embedding_bits=3), False),
    # tie_word_embeddings: the LM head is the clustered embedding (TiedDKMHead), one table for both
    "8bit-embeddings-tied-reloaded": (DKMConfig(bits=3, quantize_embeddings=True, embedding_bits=8), True),
}


def _model(config: DKMConfig, reload: bool, folder, *, tied: bool = False):
    model = quantize_model(tiny_llama(num_hidden_layers=1, tie_word_embeddings=tied), config).eval()
    if reload:
        model.save_pretrained(folder / "ckpt")
        model = AutoModelForCausalLM.from_pretrained(folder / "ckpt")
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_program_weights_decode_bitwise_to_ours(case, tmp_path):
    from hf_llmkit.compat.coremltools import load_program

    config, reload = CASES[case]
    tied = "tied" in case
    model = _model(config, reload, tmp_path, tied=tied)
    path = export_coreml(model, tmp_path / "model.mlpackage", seq_len=8, precision="float32")
    ops = list(load_program(path).functions["main"].operations)
    weights = {w.name.replace(".", "_"): w for w in palettized_weights(model)}
    luts = {op.name.removesuffix("_palettized"): op for op in ops if op.op_type == "constexpr_lut_to_dense"}
    assert set(luts) == set(weights)
    for name, op in luts.items():
        weight = weights[name]
        bits = {1: 1, 2: 2, 3: 3, 4: 4, 5: 6, 6: 6, 7: 8, 8: 8}[weight.bits]
        assert tuple(op.lut.shape) == (weight.groups, 1, 1 << bits, weight.cluster_dim)
        assert op.indices.dtype.get_bitwidth() == bits
        consumers = op.outputs[0].child_ops
        if weight.scale is not None:  # the scale constexpr follows the lookup, as built (iOS26 target)
            assert [c.op_type for c in consumers] == ["constexpr_blockwise_shift_scale"]
            assert tuple(consumers[0].scale.shape) == tuple(weight.scale.shape)
            value = consumers[0].materialized_val_inference()
            consumers = consumers[0].outputs[0].child_ops
        else:
            value = op.materialized_val_inference()
        assert {c.op_type for c in consumers} <= {"linear", "gather"}
        ours = weight.decoded().numpy()
        assert value.dtype == np.float32 and value.shape == ours.shape
        assert np.array_equal(value.view(np.int32), ours.view(np.int32)), name  # bit for bit
    values = [(op.name, op.outputs[0].val) for op in ops if op.op_type == "const"]
    dense = [name for name, v in values if isinstance(v, np.ndarray) and v.dtype == np.float32 and v.size >= 64 * 32]
    assert set(dense) == (set() if tied else {"m_lm_head_weight"}) | (  # only the unquantized weights stay dense
        set() if config.quantize_embeddings else {"m_model_embed_tokens_weight"}
    ), dense


def test_live_dkm_model_exports_what_it_computes(tmp_path):
    model = _model(DKMConfig(bits=4), False, tmp_path)
    q = model.model.layers[0].self_attn.q_proj
    (weight,) = [w for w in palettized_weights(model) if w.name.endswith("q_proj")]
    assert torch.equal(weight.decoded(), q.hard_weight(torch.float32))  # what its forward uses


def test_bad_input_is_one_value_error(tmp_path):
    with pytest.raises(ValueError, match="has no DKM layers"):
        export_coreml(tiny_llama(), tmp_path / "m.mlpackage")
    model = _model(DKMConfig(bits=3), False, tmp_path)
    with pytest.raises(ValueError, match="must end in .mlpackage"):
        export_coreml(model, tmp_path / "m.mlmodel")
    with pytest.raises(ValueError, match="precision must be one of"):
        export_coreml(model, tmp_path / "m.mlpackage", precision="int8")
    with pytest.raises(ValueError, match=r"seq_len must be an integer in \[1, 65536\]"):
        export_coreml(model, tmp_path / "m.mlpackage", seq_len=0)
    with pytest.raises(ValueError, match="expected a transformers causal LM"):
        export_coreml(torch.nn.Linear(2, 2), tmp_path / "m.mlpackage")
    (tmp_path / "file.mlpackage").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a package folder"):
        export_coreml(model, tmp_path / "file.mlpackage")
    assert not (tmp_path / "m.mlpackage").exists()


def test_float16_program_is_stateful_flexible_and_keeps_16_bit_tables(tmp_path):
    """Read back from the package: float16 compute, 16-bit tables and scales decoding to our weights rounded to
    float16, the unclustered embedding and head in float16, the cache as two float16 states updated in place, and
    `input_ids` / `causal_mask` lengths flexible up to seq_len."""
    from coremltools.converters.mil.mil import types

    from hf_llmkit.compat.coremltools import load_program

    model = _model(DKMConfig(bits=3, scale_block_size=16, lut_dtype="float16"), True, tmp_path)
    path = export_coreml(model, tmp_path / "model.mlpackage", seq_len=32)
    main = load_program(path).functions["main"]
    kinds = {name: types.is_state(v.sym_type) for name, v in main.inputs.items()}
    assert kinds == {"input_ids": False, "causal_mask": False, "keyCache": True, "valueCache": True}
    cache = main.inputs["keyCache"].sym_type.wrapped_type()
    assert types.builtin_to_string(cache.get_primitive()) == "fp16" and cache.get_shape() == (1, 1, 2, 32, 16)
    for name in ("input_ids", "causal_mask"):
        assert any(not isinstance(d, int) for d in main.inputs[name].shape), name  # symbolic: flexible
    ops = list(main.operations)
    op_types = [op.op_type for op in ops]
    assert op_types.count("read_state") == 2 and op_types.count("coreml_update_state") >= 2
    dtype = {op.name: types.builtin_to_string(op.outputs[0].dtype) for op in ops}
    assert {dtype[op.name] for op in ops if op.op_type in ("linear", "matmul", "softmax")} == {"fp16"}
    weights = {w.name.replace(".", "_"): w for w in palettized_weights(model)}
    for op in ops:
        if op.op_type != "constexpr_lut_to_dense":
            continue
        weight = weights[op.name.removesuffix("_palettized")]
        assert types.builtin_to_string(op.lut.dtype) == "fp16"
        (scales,) = op.outputs[0].child_ops
        assert types.builtin_to_string(scales.scale.dtype) == "fp16"
        value = scales.materialized_val_inference()
        ours = weight.decoded().half().numpy()  # fp16 table x fp16 scale: exact in fp32, then rounded once
        assert value.dtype == np.float16 and np.array_equal(value.view(np.int16), ours.view(np.int16)), op.name
    dense = [op for op in ops if op.op_type == "const" and getattr(op.outputs[0].val, "size", 0) >= 64 * 32]
    assert {dtype[op.name] for op in dense if "indices" not in op.name} == {"fp16"}  # embedding and head


@pytest.mark.parametrize(
    ("config", "tied"),
    [(DKMConfig(bits=4), False), (DKMConfig(bits=4, quantize_embeddings=True, embedding_bits=8), True)],
    ids=["4bit", "8bit-embeddings-tied"],
)
def test_the_traced_stateful_module_generates_our_tokens(tmp_path, config, tied):
    """The module the converter traces, driven as a device would (prefill, then one token per call with the
    cache in its buffers), generates what the model generates (a tied head: the clustered embedding's weight)."""
    from hf_llmkit.quantization.export._coreml_state import causal_mask
    from hf_llmkit.quantization.export.coreml import stateful_model

    model = _model(config, True, tmp_path, tied=tied)
    stateful = stateful_model(model, palettized_weights(model), seq_len=32, batch_size=1).eval()
    ids = torch.tensor([[5, 9, 33, 2, 7]])
    with torch.no_grad():
        ours = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 5:].tolist()
        logits = stateful(ids, causal_mask(5))
        got = []
        for step in range(6):
            got.append(int(logits[0, -1].argmax()))
            logits = stateful(torch.tensor([[got[-1]]]), causal_mask(1, past=5 + step))
    assert got == ours
