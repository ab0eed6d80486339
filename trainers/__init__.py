"""Trainer subclasses (installed as `hf_llmkit.trainers`)."""

from hf_llmkit.trainers.llmkit_trainer import LLMKitTrainer

__all__ = ["LLMKitTrainer"]
