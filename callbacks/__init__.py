"""Trainer callbacks, one per file (installed as `hf_llmkit.callbacks`).

- `SavePeftModelCallback` (save_peft.py): verified PEFT adapters (ZeRO-3 aware) in every checkpoint.
- `FaultToleranceCallback` (fault_tolerance.py): manifest-checked checkpoints, preemption, NaN/spike rollback.
- `LossScaleCallback` (loss_scale.py): the live fp16 loss scale, overflows and skipped steps in the logs.

The checkpoint modules they share: `checkpoint_manifest` (manifests, write markers), `checkpoint_status` (the
classifier: complete / unmanaged / interrupted / corrupt / incomplete), `checkpoint_housekeeping` (what may be
deleted or moved aside), and `run_end` (stop requests, and the errors that end a run with their exit codes).
"""

from hf_llmkit.callbacks.checkpoint_status import (
    CheckpointState,
    classify_checkpoint,
    latest_complete_checkpoint,
    verify_checkpoint,
)
from hf_llmkit.callbacks.fault_tolerance import FaultToleranceCallback
from hf_llmkit.callbacks.loss_scale import LossScaleCallback
from hf_llmkit.callbacks.run_end import (
    CheckpointWriteError,
    RunEndingError,
    TrainingDivergedError,
    TrainingInterrupted,
)
from hf_llmkit.callbacks.save_peft import AdapterSaveError, SavePeftModelCallback

__all__ = [
    "AdapterSaveError",
    "CheckpointState",
    "CheckpointWriteError",
    "FaultToleranceCallback",
    "LossScaleCallback",
    "RunEndingError",
    "SavePeftModelCallback",
    "TrainingDivergedError",
    "TrainingInterrupted",
    "classify_checkpoint",
    "latest_complete_checkpoint",
    "verify_checkpoint",
]
