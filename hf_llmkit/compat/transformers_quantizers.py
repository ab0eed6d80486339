"""transformers internals the DKM quantizer relies on (checked against transformers 5.23.0).

Kept in one place so a transformers upgrade breaks one tested module, not the quantizer:

- `PreTrainedModel._keep_in_fp32_modules`: the modules a model wants kept in float32. transformers' own quantizers
  (bitsandbytes, torchao) read it the same way to build their skip lists; there is no public accessor.
- `PreTrainedModel._keys_to_ignore_on_load_unexpected`: the documented way for a model to silence "unexpected key"
  reports on load. A DKM Trainer checkpoint holds two representations of each clustered layer (the training state
  and the packed export); the representation the loaded layer does not use is expected, not unexpected.

(This file is separate from `hf_llmkit/compat/transformers.py`, which holds the Trainer's private hooks.)
"""

from __future__ import annotations

CHECKED_AGAINST = "5.23.0"


def keep_in_fp32_modules(model) -> list[str]:
    """Module names the model keeps in float32 (never clustered)."""
    return sorted(getattr(model, "_keep_in_fp32_modules", None) or [])


def ignore_unexpected_keys(model, patterns: list[str]) -> None:
    """Add regex `patterns` to the keys a load of `model` does not report as unexpected."""
    current = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    model._keys_to_ignore_on_load_unexpected = current | set(patterns)
