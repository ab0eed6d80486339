"""Quiet, useful console output for training commands.

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

`configure_console(main_process=...)` sets INFO logs and dataset progress bars on the main process only; the other
ranks log warnings and errors. `keep_tensorboard_in_output_dir(trainer)` keeps TensorBoard's event files in the
run's output folder.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["configure_console", "keep_tensorboard_in_output_dir", "silence_known_noise"]

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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


def configure_console(*, main_process: bool) -> None:
    """INFO logs and progress bars of datasets on the main process; warnings only elsewhere."""
    import datasets
    import transformers

    logging.basicConfig(format=_LOG_FORMAT, level=logging.INFO if main_process else logging.WARNING)
    transformers.utils.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()  # per-save "Writing model shards" bars between the steps
    if not main_process:
        datasets.disable_progress_bars()


def keep_tensorboard_in_output_dir(trainer) -> None:
    """Point a `TensorBoardCallback` that has no folder yet at `<output_dir>/<default_logdir()>`.

    transformers 5.23's TensorBoardCallback picks its folder in `on_train_begin`; a log before it (an evaluation
    before training) would open a writer in ./runs of the current folder and keep it for the whole run.
    """
    from transformers.integrations import TensorBoardCallback
    from transformers.integrations.integration_utils import default_logdir

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TensorBoardCallback) and callback.logging_dir is None:
            callback.logging_dir = os.path.join(trainer.args.output_dir, default_logdir())
