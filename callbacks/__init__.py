"""Trainer callbacks, one per file (installed as `hf_llmkit.callbacks`).

- `SavePeftModelCallback` (save_peft.py): verified PEFT adapters (ZeRO-3 aware) in every checkpoint.
- `FaultToleranceCallback` (fault_tolerance.py): manifest-checked checkpoints, preemption, NaN/spike rollback.
- `LossScaleCallback` (loss_scale.py): the live fp16 loss scale, overflows and skipped steps in the logs.

What they share with the trainers (manifests, the classifier, rotation, the errors that end a run) is
`hf_llmkit.checkpoints`; its public names are re-exported here.
"""

from hf_llmkit.callbacks.fault_tolerance import FaultToleranceCallback
from hf_llmkit.callbacks.loss_scale import LossScaleCallback
from hf_llmkit.callbacks.save_peft import AdapterSaveError, SavePeftModelCallback
from hf_llmkit.checkpoints import (
    CheckpointState,
    CheckpointWriteError,
    RunEndingError,
    TrainingDivergedError,
    TrainingInterrupted,
    classify_checkpoint,
    latest_complete_checkpoint,
    verify_checkpoint,
)

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
