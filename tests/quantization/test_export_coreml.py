"""`export_coreml`: the Core ML program's palettized weights decode bit for bit to ours (read back from the saved
package through coremltools), for tables per tensor and per grouped channel, 3 to 5 bits, vectors, embeddings and
block scales; bad input is one ValueError."""

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
}


def _model(config: DKMConfig, reload: bool, folder):
    model = quantize_model(tiny_llama(num_hidden_layers=1), config).eval()
    if reload:
        model.save_pretrained(folder / "ckpt")
        model = AutoModelForCausalLM.from_pretrained(folder / "ckpt")
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_program_weights_decode_bitwise_to_ours(case, tmp_path):
    from hf_llmkit.compat.coremltools import load_program

    config, reload = CASES[case]
    model = _model(config, reload, tmp_path)
    path = export_coreml(model, tmp_path / "model.mlpackage", seq_len=8)
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
    assert set(dense) == {"m_lm_head_weight"} | (  # only the unquantized weights stay dense
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
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        export_coreml(model, tmp_path / "m.mlpackage", seq_len=0)
    with pytest.raises(ValueError, match="expected a transformers causal LM"):
        export_coreml(torch.nn.Linear(2, 2), tmp_path / "m.mlpackage")
