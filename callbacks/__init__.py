"""Trainer callbacks, one per file (installed as `hf_llmkit.callbacks`)."""

__all__: list[str] = []
