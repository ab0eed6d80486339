"""Where `LLMKitTrainer` resumes from, checked before any work, and how a PEFT checkpoint is loaded back.

- `resolve_resume`: the trainer's arguments (`auto_resume`, `resume_verify_checksums`) put to the one resume rule,
  `hf_llmkit.checkpoints.resume_rule.resolve_resume`.
- `prepare_output_dir`: before the run writes anything, the main process clears the way (`tidy_checkpoints`):
  our interrupted writes go, corrupt checkpoints are moved aside, and checkpoints newer than the resume point are
  kept as `abandoned-checkpoint-N` until the run has written a complete checkpoint of its own.
- `load_own_adapters`: a PEFT model is resumed with exactly the adapters it has. The Trainer would load every
  adapter subfolder of the checkpoint as one more adapter (`SavePeftModelCallback`'s `adapter/` copy among them),
  and `save_model` would then write that stale copy over the final adapter.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from hf_llmkit.checkpoints.collectives import barrier
from hf_llmkit.checkpoints.endings import ResumeError
from hf_llmkit.checkpoints.housekeeping import remove_checkpoint, tidy_checkpoints
from hf_llmkit.checkpoints.names import ROLLBACK_PREFIX, TRAINER_STATE, checkpoint_step
from hf_llmkit.checkpoints.resume_rule import resolve_resume as resolve_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["ResumeError", "load_own_adapters", "prepare_output_dir", "resolve_resume", "resume_step"]


def resolve_resume(trainer, resume_from_checkpoint: str | bool | None) -> str | None:
    """The checkpoint this `train()` call resumes from (None: from scratch), by the one rule
    (`hf_llmkit.checkpoints.resume_rule`, a model-only checkpoint included); raises `ResumeError` on a bad one."""
    args = trainer.args
    return resolve_checkpoint(
        args.output_dir,
        resume_from_checkpoint,
        auto_resume=getattr(args, "auto_resume", False),
        checksums=getattr(args, "resume_verify_checksums", True),
        save_only_model=bool(args.save_only_model),
    )


def resume_step(checkpoint: str | os.PathLike | None) -> int:
    """The global step training resumes at (0 from scratch)."""
    if checkpoint is None:
        return 0
    try:
        return int(json.loads((Path(checkpoint) / TRAINER_STATE).read_text(encoding="utf-8"))["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return checkpoint_step(checkpoint) or 0


def _probe_writable(output_dir: Path) -> None:
    """Find out now, not at the first save after training, that `output_dir` cannot be written."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".llmkit-write-probe-{os.getpid()}"
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as err:
        what = "is a file" if output_dir.is_file() else f"cannot be written ({err.strerror or err})"
        raise ResumeError(f"output_dir {output_dir} {what}; pass a writable folder as --output_dir") from err


def prepare_output_dir(trainer, checkpoint: str | None) -> None:
    """Main process: clear `output_dir` for a run that starts at `checkpoint`; every rank waits for it.

    Also removes restart points a killed run left behind (`llmkit-rollback-*`, ours and never resumed from).
    """
    output_dir = Path(trainer.args.output_dir)
    barrier()  # every rank has chosen its resume point before anything moves
    if trainer.args.should_save:
        _probe_writable(output_dir)
        tidy_checkpoints(output_dir, resume_step=resume_step(checkpoint))
        keep = Path(checkpoint).resolve() if checkpoint is not None else None
        for folder in output_dir.glob(f"{ROLLBACK_PREFIX}-*"):
            if folder.resolve() != keep:
                remove_checkpoint(folder)
    barrier()


def _peft_model(model):
    from peft import PeftModel

    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, PeftModel):
            return candidate
    return None


def load_own_adapters(model, checkpoint: str) -> bool:
    """Load each adapter `model` has from `checkpoint` (default at its root, others in `<name>/`); False if not PEFT.

    No adapter is added: subfolders that are not adapters of the model (e.g. `SavePeftModelCallback`'s copy) are
    ignored, and an adapter missing from the checkpoint is an error naming it.
    """
    peft_model = _peft_model(model)
    if peft_model is None:
        return False
    for name in list(peft_model.peft_config):
        folder = Path(checkpoint) if name == "default" else Path(checkpoint) / name
        if not any((folder / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
            raise ResumeError(
                f"checkpoint {checkpoint} holds no weights for the adapter {name!r} ({folder} has no "
                "adapter_model.safetensors); resume from a checkpoint of this run"
            )
        peft_model.load_adapter(str(folder), name, is_trainable=name in peft_model.active_adapters)
    return True
