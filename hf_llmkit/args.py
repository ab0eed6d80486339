"""`LLMKitTrainingArguments`: the HF `TrainingArguments` plus every knob hf_llmkit adds.

It is a plain dataclass subclass, so `HfArgumentParser` turns each field into a `--flag` and
`LLMKitTrainer` reads them. Fields are grouped by feature; each documents itself twice (docstring and
`help`), as transformers' own arguments do, and is validated in `__post_init__` with a `ValueError`
that names the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import TrainingArguments


@dataclass
class LLMKitTrainingArguments(TrainingArguments):
    """`TrainingArguments` extended with hf_llmkit's options.

    Args:
        (every `transformers.TrainingArguments` argument)
    """

    def __post_init__(self):
        super().__post_init__()
