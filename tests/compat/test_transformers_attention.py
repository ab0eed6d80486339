"""The transformers internals behind hf_llmkit's attention stack still exist (hf_llmkit.compat.transformers)."""

from __future__ import annotations

import inspect

import transformers

from hf_llmkit.compat.transformers import (
    CHECKED_AGAINST,
    ConfigReportingKernel,
    configured_attention,
    model_eager_attention,
)
from hf_llmkit.testing import tiny_llama

WHY = f"checked against transformers {CHECKED_AGAINST}, installed {transformers.__version__}: update hf_llmkit.compat"


def test_the_configured_implementation_is_what_set_attn_implementation_set():
    model = tiny_llama(attn_implementation="sdpa")
    assert configured_attention(model.config) == "sdpa", WHY
    model.set_attn_implementation("eager")
    assert configured_attention(model.config) == "eager", WHY
    assert configured_attention(model.model.config) == "eager", WHY


def test_flash_kernels_still_read_the_module_config_and_the_view_reports_the_kernel():
    from transformers.integrations import flash_attention

    assert "module.config._attn_implementation" in inspect.getsource(flash_attention.flash_attention_forward), WHY
    config = tiny_llama().config
    view = ConfigReportingKernel(config, "flash_attention_2")
    assert view._attn_implementation == "flash_attention_2" and view.hidden_size == config.hidden_size


def test_modeling_files_still_define_a_module_level_eager_function():
    from transformers.models.llama import modeling_llama

    layer = tiny_llama().model.layers[0].self_attn
    assert model_eager_attention(layer) is modeling_llama.eager_attention_forward, WHY
    assert model_eager_attention(object()) is None
