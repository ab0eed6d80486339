"""Run by test_run_endings.py in a process of its own: train with a real file size limit that hits the second save.

`python tests/trainers/file_limit_run.py OUT` trains the tiny model 6 steps with a checkpoint every 2 steps. After
checkpoint-2 is complete it sets RLIMIT_FSIZE (with SIGXFSZ ignored, so writes fail with EFBIG instead of killing
the process) just above the size of the model file: the kernel then refuses the optimizer state of checkpoint-4.
"""

from __future__ import annotations

import resource
import signal
import sys
from pathlib import Path

from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_llmkit.callbacks import FaultToleranceCallback  # noqa: E402
from tests.callbacks.support import make_trainer  # noqa: E402


class LimitFileSize(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            model = Path(args.output_dir) / "checkpoint-2" / "model.safetensors"
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (model.stat().st_size + 1024, resource.RLIM_INFINITY))


if __name__ == "__main__":
    make_trainer(sys.argv[1], callbacks=[FaultToleranceCallback(), LimitFileSize()], max_steps=6).train()
