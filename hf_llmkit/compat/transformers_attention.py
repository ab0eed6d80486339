"""transformers internals hf_llmkit's attention stack relies on (checked against transformers 5.23.0).

transformers lets a plugin register attention functions (`AttentionInterface.register`) and mask builders
(`AttentionMaskInterface.register`) and switch a model to one (`PreTrainedModel.set_attn_implementation`), but it
has no public way to *read* which implementation a model uses, and a few of its own kernels read that private
attribute from the module they are handed. Every such use is here:

- `config._attn_implementation`: the implementation the model dispatches to (there is no public getter);
- flash-attention kernels read `module.config._attn_implementation` to pick the flash library, so a wrapper that
  hands them a module must report the kernel's own name there;
- "eager" is not in `ALL_ATTENTION_FUNCTIONS`: each modeling file defines its own `eager_attention_forward`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

CHECKED_AGAINST = "5.23.0"


def configured_attention(config: Any) -> str | None:
    """The attention implementation name a model with this config dispatches to (`None` before it was resolved)."""
    return config._attn_implementation


class ConfigReportingKernel:
    """A model config whose `_attn_implementation` reports `kernel` (what a flash kernel reads to pick its library)."""

    def __init__(self, config: Any, kernel: str) -> None:
        self._config, self._attn_implementation = config, kernel

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def model_eager_attention(module: Any) -> Callable[..., Any] | None:
    """The `eager_attention_forward` of the modeling file that defines `module`'s class, or None."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
