"""Quiet, useful console output for training commands.

`configure_console(main_process=...)` sets INFO logs and dataset progress bars on the main process only; the other
ranks log warnings and errors. `keep_tensorboard_in_output_dir(trainer)` keeps TensorBoard's event files in the
run's output folder. (The upstream messages nobody can act on are dropped by `import hf_llmkit`: `hf_llmkit.noise`.)
"""

from __future__ import annotations

import logging
import os

__all__ = ["configure_console", "keep_tensorboard_in_output_dir"]

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
