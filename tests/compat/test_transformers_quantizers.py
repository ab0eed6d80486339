"""The transformers internals the DKM quantizer relies on (hf_llmkit.compat.transformers) still exist and work."""

from __future__ import annotations

import inspect

import transformers
from transformers import PreTrainedModel

from hf_llmkit.compat.transformers import (
    CHECKED_AGAINST,
    ignore_unexpected_keys,
    keep_in_fp32_modules,
    missing_quantizer_internals,
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


def test_ignored_unexpected_keys_are_dropped_from_the_load_report():
    source = inspect.getsource(PreTrainedModel._adjust_missing_and_unexpected_keys)
    assert "_keys_to_ignore_on_load_unexpected" in source, HINT
    model = tiny_llama()
    ignore_unexpected_keys(model, [r"(^|\.)lm_head\.centroids$"])
    assert r"(^|\.)lm_head\.centroids$" in model._keys_to_ignore_on_load_unexpected


def test_quantizer_hooks_are_still_called_with_the_checkpoint_files():
    missing = missing_quantizer_internals()
    assert not missing, f"{missing}: {HINT}"
