"""The transformers internals the DKM quantizer relies on (hf_llmkit.compat.transformers) still exist and work."""

from __future__ import annotations

import inspect

import torch
import transformers
from transformers import PreTrainedModel

from hf_llmkit.compat.transformers import (
    CHECKED_AGAINST,
    ignore_unexpected_keys,
    keep_in_fp32_modules,
    missing_quantizer_internals,
    tied_parameters,
    untie,
)
from hf_llmkit.testing import tiny_llama

HINT = (
    f"transformers {transformers.__version__} changed it (checked against {CHECKED_AGAINST}); update the compat module"
)


def test_keep_in_fp32_modules_is_still_the_models_attribute():
    assert hasattr(PreTrainedModel, "_keep_in_fp32_modules"), HINT
    model = tiny_llama()
    model._keep_in_fp32_modules = {"lm_head"}
    assert keep_in_fp32_modules(model) == ["lm_head"]


def test_a_dropped_tie_is_not_made_by_the_loads_tie_weights():
    model = tiny_llama(tie_word_embeddings=True)
    assert tied_parameters(model) == {"lm_head.weight": "model.embed_tokens.weight"}, HINT
    model.lm_head.weight = torch.nn.Parameter(torch.zeros_like(model.lm_head.weight))
    untie(model, "lm_head.weight")
    model.tie_weights(recompute_mapping=False)  # what from_pretrained calls
    assert tied_parameters(model) == {} and model.lm_head.weight is not model.model.embed_tokens.weight, HINT
    model.tie_weights(recompute_mapping=False, missing_keys=set())
    assert model.lm_head.weight is not model.model.embed_tokens.weight, HINT


def test_ignored_unexpected_keys_are_dropped_from_the_load_report():
    source = inspect.getsource(PreTrainedModel._adjust_missing_and_unexpected_keys)
    assert "_keys_to_ignore_on_load_unexpected" in source, HINT
    model = tiny_llama()
    ignore_unexpected_keys(model, [r"(^|\.)lm_head\.centroids$"])
    assert r"(^|\.)lm_head\.centroids$" in model._keys_to_ignore_on_load_unexpected


def test_quantizer_hooks_are_still_called_with_the_checkpoint_files():
    missing = missing_quantizer_internals()
    assert not missing, f"{missing}: {HINT}"


def test_quantizer_helpers_are_still_transformers_own():
    """`get_quantize_ops` returns a `ConversionOps`, and the helpers behave as the built-in quantizers rely on."""
    import transformers.core_model_loading as loading
    import transformers.quantizers.quantizers_utils as utils

    from hf_llmkit.compat.transformers import ConversionOps, get_module_from_name, should_convert_module
    from hf_llmkit.quantization.integration import DKMInitTables

    assert ConversionOps is loading.ConversionOps and issubclass(DKMInitTables, ConversionOps), HINT
    assert get_module_from_name is utils.get_module_from_name, HINT
    model = tiny_llama()
    module, tensor = get_module_from_name(model, "model.layers.0.mlp.down_proj.weight")
    assert module is model.model.layers[0].mlp.down_proj and tensor == "weight", HINT
    assert should_convert_module("model.layers.0.mlp.down_proj", ["q_proj"]), HINT
    assert not should_convert_module("lm_head", ["lm_head"]), HINT


def test_the_registries_say_dkm_is_registered():
    from transformers.quantizers import auto

    from hf_llmkit.compat.transformers import quantization_method_registered
    from hf_llmkit.quantization import DKMConfig, DKMHfQuantizer, register_dkm

    assert quantization_method_registered("dkm") == (True, True), HINT
    assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING["dkm"] is DKMConfig, HINT
    assert auto.AUTO_QUANTIZER_MAPPING["dkm"] is DKMHfQuantizer, HINT
    assert quantization_method_registered("no-such-method") == (False, False)
    register_dkm()  # registering twice raises in transformers: the registry check keeps it a no-op
