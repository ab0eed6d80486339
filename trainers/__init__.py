"""Trainer subclasses and the training-loop logic they need (installed as `hf_llmkit.trainers`)."""

from hf_llmkit.checkpoints.endings import ResumeError
from hf_llmkit.trainers.llmkit_trainer import LLMKitTrainer

__all__ = ["LLMKitTrainer", "ResumeError"]
