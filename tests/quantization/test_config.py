"""DKMConfig: validation with actionable errors, config.json round trip, idempotent registration with transformers."""

from __future__ import annotations

import importlib
import json

import pytest
from transformers.quantizers import auto

import hf_llmkit
from hf_llmkit import DKMConfig
from hf_llmkit.compat.transformers import quantization_method_registered
from hf_llmkit.quantization import DKMHfQuantizer, register_dkm


@pytest.mark.parametrize("bits", [0, 9, -1, 2.5, True])
def test_bits_out_of_range(bits):
    with pytest.raises(ValueError, match="bits must be an integer from 1 to 8"):
        DKMConfig(bits=bits)


def test_embedding_bits_out_of_range():
    with pytest.raises(ValueError, match="embedding_bits"):
        DKMConfig(embedding_bits=12)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cluster_dim": 0}, "cluster_dim must be a positive integer"),
        ({"granularity": "per_row"}, "granularity must be one of"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"epsilon": -1.0}, "epsilon must be > 0"),
        ({"dkm_iters": -1}, "dkm_iters must be an integer >= 0"),
        ({"quant_method": "gptq"}, "quant_method must be 'dkm'"),
        ({"scale_block_size": -1}, r"scale_block_size must be an integer >= 0 \(try 64, or 0\)"),
        ({"scale_block_size": True}, "scale_block_size must be an integer >= 0"),
        ({"scale_block_size": 64, "cluster_dim": 2}, "scales scalar weights: use cluster_dim=1 or set it to 0"),
    ],
)
def test_invalid_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DKMConfig(**kwargs)


def test_check_shape_names_the_fix():
    cfg = DKMConfig(cluster_dim=3)
    with pytest.raises(
        ValueError, match=r"cluster_dim=3 does not divide the input dimension 64 of .q.*modules_to_not"
    ):
        cfg.check_shape("q", 64, 64)
    grouped = DKMConfig(granularity="per_grouped_channel", group_size=5)
    with pytest.raises(ValueError, match="group_size=5 does not divide the 64 output channels"):
        grouped.check_shape("q", 64, 64)
    with pytest.raises(ValueError, match="scale_block_size=48 does not divide the input dimension 64 of 'q'"):
        DKMConfig(scale_block_size=48).check_shape("q", 64, 64)


def test_defaults_and_json_round_trip():
    cfg = DKMConfig(bits=4, cluster_dim=2, quantize_embeddings=True, shard=True)
    assert DKMConfig.from_dict({"bits": 4}).scale_block_size == 0  # a config.json written before it existed
    assert cfg.quant_method == "dkm"
    assert cfg.modules_to_not_convert == ["lm_head"]
    saved = json.loads(cfg.to_json_string())
    # transformers rebuilds the saved dict with cls(**dict): every saved key must be accepted.
    again = DKMConfig.from_dict(saved)
    assert again == cfg
    assert auto.AutoQuantizationConfig.from_dict(saved) == cfg


def test_registered_and_idempotent():
    assert quantization_method_registered("dkm") == (True, True)
    assert type(auto.AutoQuantizationConfig.from_dict({"quant_method": "dkm"})) is DKMConfig
    register_dkm()
    register_dkm()
    importlib.reload(importlib.import_module("hf_llmkit"))
    assert hf_llmkit.DKMConfig is DKMConfig
    quantizer = auto.AutoHfQuantizer.from_config(DKMConfig(bits=2), pre_quantized=False)
    assert isinstance(quantizer, DKMHfQuantizer)
    assert quantizer.is_serializable() and quantizer.is_trainable and quantizer.is_qat_trainable
    assert quantizer.quantized_element_size == 0.25
