"""Trainer callbacks, one per file (installed as `hf_llmkit.callbacks`).

- `SavePeftModelCallback` (save_peft.py): verified PEFT adapters (ZeRO-3 aware) in every checkpoint.
- `FaultToleranceCallback` (fault_tolerance.py): manifest-checked checkpoints, preemption, NaN/spike rollback.
- `LossScaleCallback` (loss_scale.py): the live fp16 loss scale, overflows and skipped steps in the logs.
"""

from hf_llmkit.callbacks.checkpoint_manifest import latest_complete_checkpoint, verify_checkpoint
from hf_llmkit.callbacks.fault_tolerance import FaultToleranceCallback
from hf_llmkit.callbacks.loss_scale import LossScaleCallback
from hf_llmkit.callbacks.recovery import TrainingDivergedError
from hf_llmkit.callbacks.save_peft import AdapterSaveError, SavePeftModelCallback

__all__ = [
    "AdapterSaveError",
    "FaultToleranceCallback",
    "LossScaleCallback",
    "SavePeftModelCallback",
    "TrainingDivergedError",
    "latest_complete_checkpoint",
    "verify_checkpoint",
]
