"""The private Trainer hooks LLMKitTrainer overrides still exist with the parameters it relies on."""

from __future__ import annotations

import sys

import transformers

from hf_llmkit.compat.transformers import CHECKED_AGAINST, TRAINER_PRIVATE_HOOKS, missing_trainer_internals
from hf_llmkit.trainers import LLMKitTrainer


def test_trainer_internals_are_still_there():
    missing = missing_trainer_internals()
    assert not missing, (
        f"transformers {transformers.__version__} changed what LLMKitTrainer overrides (checked against "
        f"{CHECKED_AGAINST}): {missing}; update hf_llmkit.compat.transformers and hf_llmkit.trainers"
    )


def test_every_private_override_is_declared():
    private = {name for name in vars(LLMKitTrainer) if name.startswith("_") and not name.startswith("__")}
    overridden = {name for name in private if hasattr(transformers.Trainer, name)}
    assert overridden == set(TRAINER_PRIVATE_HOOKS), "declare private Trainer overrides in compat.transformers"
    doc = sys.modules[LLMKitTrainer.__module__].__doc__
    assert all(f"`{name}`" in doc for name in TRAINER_PRIVATE_HOOKS)  # listed, with why, where users read
