"""transformers still collects router logits through the forward hook `compat.transformers.record_router_logits`
installs (the hook its own Mixtral / Qwen2-MoE routers get), with the parameters it is called with."""

from __future__ import annotations

import inspect

import transformers

from hf_llmkit.compat.transformers import CHECKED_AGAINST, _router_hook_installer


def test_the_router_logits_hook_is_still_there_with_its_parameters():
    install = _router_hook_installer()
    assert install is not None, (
        f"transformers {transformers.__version__} (checked against {CHECKED_AGAINST}) no longer has "
        "utils.output_capturing.install_output_capuring_hook: update compat.transformers.record_router_logits"
    )
    assert list(inspect.signature(install).parameters)[:3] == ["module", "key", "index"]
    from transformers.models.mixtral.modeling_mixtral import MixtralPreTrainedModel

    assert "router_logits" in MixtralPreTrainedModel._can_record_outputs  # the key the hook files the logits under
