"""Trainer subclasses and the training-loop logic they need (installed as `hf_llmkit.trainers`)."""

from hf_llmkit.trainers.llmkit_trainer import LLMKitTrainer
from hf_llmkit.trainers.resume import ResumeError

__all__ = ["LLMKitTrainer", "ResumeError"]
