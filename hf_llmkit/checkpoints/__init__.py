"""The one owner of "complete": which checkpoints can be resumed from, and how a folder becomes one.

Both `hf_llmkit.trainers` and `hf_llmkit.callbacks` import this package; neither imports the other.

- `names`: every file and folder name (`trainer_state.json`, the manifest, the writing marker, prefixes, the lock).
- `exit_codes`: the one table of exit statuses; `endings`: the errors that end a run with them.
- `manifest`: manifests and writing markers; `status`: the classifier (complete / unmanaged / interrupted /
  corrupt / incomplete) and `latest_complete_checkpoint`; `housekeeping`: what may be deleted or moved aside, and
  rotation; `retries`: transient write errors and the one line a failed write ends with.
- `transaction`: every save as one transaction (begin -> the registered contributors' parts -> complete -> rotate);
  `lifecycle`: its two ends; `resume_rule`: where a run resumes from; `lock`: one run per output folder.
- `collectives`: the few collectives checkpoint writes need; `loss_watch`: when a run must roll back;
  `preemption`: the signals that make a run save and stop.

Resume a run of any `Trainer` from its newest checkpoint that is complete (never a half-written one, which is what
`transformers.trainer_utils.get_last_checkpoint` and `resume_from_checkpoint=True` can pick):

    ```python
    from hf_llmkit.checkpoints import latest_complete_checkpoint

    trainer.train(resume_from_checkpoint=latest_complete_checkpoint(trainer.args.output_dir))
    ```
"""

from hf_llmkit.checkpoints.endings import (
    CheckpointWriteError,
    ResumeError,
    RunEndingError,
    TrainingDivergedError,
    TrainingInterrupted,
)
from hf_llmkit.checkpoints.exit_codes import EXIT_DIVERGED, EXIT_IO_ERROR, EXIT_PREEMPTED, EXIT_USAGE
from hf_llmkit.checkpoints.status import (
    CheckpointState,
    CheckpointVerdict,
    classify_checkpoint,
    latest_complete_checkpoint,
    verify_checkpoint,
)

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_IO_ERROR",
    "EXIT_PREEMPTED",
    "EXIT_USAGE",
    "CheckpointState",
    "CheckpointVerdict",
    "CheckpointWriteError",
    "ResumeError",
    "RunEndingError",
    "TrainingDivergedError",
    "TrainingInterrupted",
    "classify_checkpoint",
    "latest_complete_checkpoint",
    "verify_checkpoint",
]
