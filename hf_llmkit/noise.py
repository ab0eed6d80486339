"""Upstream console messages nobody can act on, dropped when `hf_llmkit` is imported.

`silence_known_noise()` drops a few upstream messages that a user of a default run cannot act on, each matched
exactly at its source (a filter on the emitting logger, or a warnings filter for one message), never a blanket
filter; `import hf_llmkit` installs them, before peft / bitsandbytes / DeepSpeed are imported:

- bitsandbytes on CPUs with AVX512-bf16: "Failed to load CPU gemm_4bit_forward from kernels-community" (the
  optional `kernels` package downloads its kernel from the Hub; the built-in CPU path is used instead);
- bitsandbytes' LLM.int8 on CPU: "MatMul8bitLt: inputs will be cast from ... to float16", once per matmul;
- DeepSpeed on a machine without an accelerator: "Setting accelerator to CPU" (kept where an accelerator exists,
  since there it means detection failed);
- peft reading transformers' deprecated `is_gradient_checkpointing` (a FutureWarning about peft's code);
- DeepSpeed calling torch's deprecated `all_gather_into_tensor` (a FutureWarning about DeepSpeed's code);
- accelerate under the Trainer with DeepSpeed: "Gradient accumulation steps mismatch: GradientAccumulationPlugin
  has 1, DeepSpeed config has N. Using DeepSpeed's value." (the Trainer fills DeepSpeed's value from its own
  `gradient_accumulation_steps`, so the value used is the one asked for).
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["silence_known_noise"]


class _DropMessage(logging.Filter):
    """Drops the records of one logger whose message contains `text` (one known message, nothing else)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in str(record.msg)


def _drop(logger_name: str, text: str) -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _DropMessage) and f.text == text for f in logger.filters):
        logger.addFilter(_DropMessage(text))


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator.is_available()) if accelerator is not None else torch.cuda.is_available()


def silence_known_noise() -> None:
    """Install the narrow filters listed in the module docstring (idempotent)."""
    _drop("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community")
    _drop("bitsandbytes.autograd._functions", "MatMul8bitLt: inputs will be cast from")
    if not _has_accelerator():
        _drop("DeepSpeed", "Setting accelerator to CPU.")
    _drop("accelerate.accelerator", "Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1,")
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated", category=FutureWarning
    )
