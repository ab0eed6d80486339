"""`LLMKitTrainingArguments`: the HF `TrainingArguments` plus every knob hf_llmkit adds.

It is a plain dataclass subclass, so `HfArgumentParser` turns each field into a `--flag` and
`LLMKitTrainer` reads them. Fields are grouped by feature; each documents itself twice (docstring and
`help`), as transformers' own arguments do, and is validated in `__post_init__` with a `ValueError`
that names the fix.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from transformers import TrainingArguments

logger = logging.getLogger(__name__)


def _has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator.is_available()) if accelerator is not None else torch.cuda.is_available()


@dataclass
class LLMKitTrainingArguments(TrainingArguments):
    """`TrainingArguments` extended with hf_llmkit's options.

    Beyond the added fields, one behaviour differs from `TrainingArguments`: launched on several ranks
    (`accelerate launch --multi_gpu`, `torchrun`) on a machine without an accelerator, the plain arguments
    leave accelerate in single-process mode and every rank trains its own copy of the model; here `use_cpu`
    is switched on so the ranks form one gloo data-parallel group (accelerate's MULTI_CPU).

    Args:
        (every `transformers.TrainingArguments` argument)
    """

    def __post_init__(self):
        multi_rank = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if multi_rank and not self.use_cpu and not self.deepspeed and not _has_accelerator():
            logger.info("no accelerator: training on %s CPU ranks with gloo", os.environ["WORLD_SIZE"])
            self.use_cpu = True
        super().__post_init__()
