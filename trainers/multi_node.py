"""Where a run on several machines keeps its checkpoints: one output folder every machine sees.

A checkpoint holds files each rank writes (its RNG state) next to files one process writes for all (model,
optimizer, trainer state, manifest), so every machine must see the same folder. `save_on_each_node`, meant for
machines without a shared filesystem, does not give them one in transformers 5.23: `save_pretrained` writes the
model only on global rank 0, so the other machines' checkpoints hold optimizer and trainer state but no model.

- `check_output_dir_sharing` (before training, every rank): rank 0 writes a probe file into `output_dir` and every
  rank looks for it. A folder some machine does not see, or `save_on_each_node` with more than one writing process,
  stops the run with one line before any work; otherwise a restart would resume different steps on different
  machines, or several processes would write the same files at once.
- `agree_on_checkpoint` (auto-resume, every rank): every rank resumes from the checkpoint rank 0 chose. A rank that
  does not see a complete copy of it yet (a network filesystem that shows the newest manifest late) stops the run
  with one line naming that rank, instead of resuming another step than the others.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import torch.distributed as dist

from hf_llmkit.checkpoints.collectives import barrier, world_size
from hf_llmkit.checkpoints.endings import ResumeError
from hf_llmkit.checkpoints.status import classify_checkpoint

__all__ = ["agree_on_checkpoint", "check_output_dir_sharing"]

PROBE_PREFIX = ".llmkit-shared-probe-"
PROBE_WAIT_S = 5.0  # a network filesystem may show a new file to the other machines a moment later


def _gather(value) -> list:
    values = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def _sees(path: Path, *, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while not path.is_file():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def check_output_dir_sharing(args) -> None:
    """Every rank: raise `ResumeError` (one line) unless every rank sees `output_dir` and one process saves into it.

    A run that writes no checkpoints (`save_strategy="no"`) has nothing to resume and is not checked."""
    if world_size() == 1 or getattr(args, "save_strategy", None) == "no":  # SaveStrategy is a str enum
        return
    output_dir = Path(args.output_dir)
    token = None
    if dist.get_rank() == 0:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            token = secrets.token_hex(8)
            (output_dir / f"{PROBE_PREFIX}{token}").write_text(token)
        except OSError:
            token = None  # an unwritable folder is reported by the output-folder check that follows
    token = _gather(token)[0]
    if token is None:
        return
    probe = output_dir / f"{PROBE_PREFIX}{token}"
    views = _gather((_sees(probe, wait=PROBE_WAIT_S), bool(args.should_save)))
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    barrier()
    blind = [rank for rank, (seen, _) in enumerate(views) if not seen]
    writers = sum(saves for _, saves in views)
    if blind:
        raise ResumeError(
            f"output_dir {output_dir} is not one folder for all machines: rank {blind[0]} does not see the files "
            "rank 0 writes there, so its checkpoints would be incomplete; put --output_dir on a filesystem every "
            "machine mounts"
        )
    if args.save_on_each_node and writers > 1:
        raise ResumeError(
            f"--save_on_each_node on {writers} machines: with the output folder {output_dir} they all see, they "
            "would write the same checkpoint files at once (and transformers writes the model only from rank 0); "
            "drop --save_on_each_node"
        )


def agree_on_checkpoint(args, found: str | None, *, checksums: bool = True) -> str | None:
    """The checkpoint every rank resumes from: rank 0's choice (its name, looked up in each rank's `output_dir`)."""
    if world_size() == 1:
        return found
    chosen = _gather(Path(found).name if found is not None else None)[0]
    if chosen is None:
        return None
    local = Path(args.output_dir) / chosen
    usable = (found is not None and Path(found).name == chosen) or classify_checkpoint(
        local, checksums=checksums
    ).resumable
    views = _gather(None if usable else str(local))
    missing = [(rank, path) for rank, path in enumerate(views) if path is not None]
    if missing:
        rank, path = missing[0]
        raise ResumeError(
            f"rank 0 resumes from {chosen}, but rank {rank} has no complete copy of it ({path}); let every machine "
            "see the same --output_dir, or pass --resume_from_checkpoint with a checkpoint every machine sees"
        )
    return str(local)
