"""The transformers internals `hf_llmkit.compat.transformers_quantizers` relies on still exist and still work."""

from __future__ import annotations

import inspect

import transformers
from transformers import PreTrainedModel

from hf_llmkit.compat.transformers_quantizers import CHECKED_AGAINST, ignore_unexpected_keys, keep_in_fp32_modules
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
