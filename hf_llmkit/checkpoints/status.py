"""Which checkpoints can be resumed from: one classifier used by resume, rotation and verification.

`classify_checkpoint(folder)` puts every folder into one of five states, and each state has one rule:

| state         | how it is recognised                                   | resume | may be deleted              |
|---------------|--------------------------------------------------------|--------|-----------------------------|
| `complete`    | its manifest matches every file                        | yes    | by `save_total_limit` only  |
| `unmanaged`   | no manifest, no marker, and it loads (safetensors      | yes    | by `save_total_limit` only  |
|               | headers, torch archives, `trainer_state.json`): a      |        |                             |
|               | plain `Trainer`, `--no_fault_tolerance`, an older run  |        |                             |
| `interrupted` | our writing marker, or the Trainer's just-in-time      | no     | yes (it is dead)            |
|               | marker `checkpoint-is-incomplete.txt`, and no manifest: |        |                             |
|               | the write was cut                                      |        |                             |
| `corrupt`     | a manifest that does not match (edited, truncated,     | no     | never: moved aside          |
|               | damaged, or listing paths outside the folder)          |        |                             |
| `incomplete`  | no manifest, no marker, and it does not load           | no     | never: moved aside or left  |

Example:
    ```python
    from hf_llmkit.checkpoints import latest_complete_checkpoint

    trainer.train(resume_from_checkpoint=latest_complete_checkpoint("outputs/run"))
    ```
"""

from __future__ import annotations

import enum
import json
import logging
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

from hf_llmkit.checkpoints.manifest import check_manifest, is_writing, read_manifest
from hf_llmkit.checkpoints.names import (
    JIT_INCOMPLETE_MARKER,
    OPTIMIZER_FILE_PATTERNS,
    TMP_MARK,
    TRAINER_STATE,
    checkpoint_step,
    list_checkpoints,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointState",
    "CheckpointVerdict",
    "classify_checkpoint",
    "holds_model_only",
    "latest_complete_checkpoint",
    "problem_when_loading",
    "verify_checkpoint",
]

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
_MAX_HEADER = 100 << 20  # safetensors refuses larger headers too


class CheckpointState(str, enum.Enum):
    COMPLETE = "complete"
    UNMANAGED = "unmanaged"
    INTERRUPTED = "interrupted"
    CORRUPT = "corrupt"
    INCOMPLETE = "incomplete"


@dataclass(frozen=True)
class CheckpointVerdict:
    """The state of one folder and, unless it is complete, why."""

    path: Path
    state: CheckpointState
    reason: str | None = None

    @property
    def resumable(self) -> bool:
        return self.state in (CheckpointState.COMPLETE, CheckpointState.UNMANAGED)

    def describe(self) -> str:
        return f"{self.path.name} is {self.state.value}" + (f": {self.reason}" if self.reason else "")


# -- validation by loading (folders without a manifest) -----------------------------------------------------
def _safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return "shorter than a safetensors header"
        length = int.from_bytes(head, "little")
        if length > min(size - 8, _MAX_HEADER):
            return "its header is longer than the file"
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, ValueError):
            return "its header is not JSON"
    try:
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except (AttributeError, IndexError, KeyError, TypeError):
        return "its header has no data offsets"
    if 8 + length + end != size:
        return f"it has {size} bytes, its header describes {8 + length + end}"
    return None


def _torch_archive_problem(path: Path) -> str | None:
    if not zipfile.is_zipfile(path):
        return "not a torch archive (truncated?)"
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"record {info.filename} runs past the end of the file"
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        return f"unreadable archive ({err})"
    return None


def _json_problem(path: Path) -> str | None:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        return f"not valid JSON ({err})"
    return None


_CHECKS = {
    ".safetensors": _safetensors_problem,
    ".pt": _torch_archive_problem,
    ".pth": _torch_archive_problem,
    ".bin": _torch_archive_problem,
    ".json": _json_problem,
}


def _has_weights(folder: Path) -> bool:
    if any((folder / name).is_file() for name in _WEIGHT_FILES):
        return True
    # DeepSpeed (`global_stepN/`), FSDP (`pytorch_model_fsdp*`), or PEFT multi-adapter subfolders
    return any(
        p.name.startswith(("global_step", "pytorch_model_fsdp")) or (p / "adapter_model.safetensors").is_file()
        for p in folder.iterdir()
    )


def problem_when_loading(folder: str | os.PathLike, *, expected_step: int | None = None) -> str | None:
    """Why a checkpoint folder without a manifest cannot be resumed from, or None when it loads.

    Reads what a loader reads first: `trainer_state.json`, every safetensors header (its data must fill the file),
    every torch archive's directory (a truncated file has none) and every JSON file.
    """
    folder = Path(folder)
    state = folder / TRAINER_STATE
    if not state.is_file():
        return f"no {TRAINER_STATE}"
    try:
        step = json.loads(state.read_text(encoding="utf-8")).get("global_step")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as err:
        return f"{TRAINER_STATE} does not parse ({err})"
    if not isinstance(step, int):
        return f"{TRAINER_STATE} has no global_step"
    if expected_step is not None and step != expected_step:
        return f"{TRAINER_STATE} is for step {step}, not {expected_step} (a renamed folder)"
    if not _has_weights(folder):
        return "no model or adapter weights"
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if TMP_MARK not in d]
        for name in filenames:
            path = Path(dirpath) / name
            check = _CHECKS.get(path.suffix)
            if check is None or TMP_MARK in name:
                continue
            try:
                problem = check(path)
            except OSError as err:
                problem = f"unreadable ({err.strerror or err})"
            if problem:
                return f"{path.relative_to(folder).as_posix()}: {problem}"
    return None


# -- the classifier -----------------------------------------------------------------------------------------
def classify_checkpoint(folder: str | os.PathLike, *, checksums: bool = True) -> CheckpointVerdict:
    """The state of `folder` (see the module docstring); `checksums=False` compares sizes only."""
    folder = Path(folder)
    if not folder.is_dir():
        return CheckpointVerdict(folder, CheckpointState.INCOMPLETE, "not a folder")
    try:
        manifest = read_manifest(folder)
    except ValueError as err:
        return CheckpointVerdict(folder, CheckpointState.CORRUPT, str(err))
    step = checkpoint_step(folder)
    if manifest is not None:
        reason = check_manifest(folder, manifest, checksums=checksums)
        recorded = manifest.get("step")
        if reason is None and step is not None and recorded is not None and recorded != step:
            reason = f"renamed: its manifest is for checkpoint-{recorded}"
        state = CheckpointState.COMPLETE if reason is None else CheckpointState.CORRUPT
        return CheckpointVerdict(folder, state, reason)
    if is_writing(folder):
        return CheckpointVerdict(folder, CheckpointState.INTERRUPTED, "our write of it never finished")
    if (folder / JIT_INCOMPLETE_MARKER).exists():
        reason = f"the Trainer's just-in-time checkpoint of it never finished ({JIT_INCOMPLETE_MARKER})"
        return CheckpointVerdict(folder, CheckpointState.INTERRUPTED, reason)
    reason = problem_when_loading(folder, expected_step=step)
    if reason is None:
        return CheckpointVerdict(folder, CheckpointState.UNMANAGED, "no manifest, but it loads")
    return CheckpointVerdict(folder, CheckpointState.INCOMPLETE, f"no manifest and {reason}")


def holds_model_only(folder: str | os.PathLike) -> bool:
    """Whether a checkpoint holds the model but no optimizer or scheduler state (saved with `save_only_model=True`):
    resumed from, the optimizer and the learning-rate schedule start over."""
    folder = Path(folder)
    return not any(any(folder.glob(pattern)) for pattern in OPTIMIZER_FILE_PATTERNS)


def verify_checkpoint(folder: str | os.PathLike, *, checksums: bool = True) -> str | None:
    """None when `folder` (a checkpoint, or a model / adapter folder we wrote) matches its manifest, else why not."""
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except ValueError as err:
        return str(err)
    if manifest is None:
        if is_writing(folder):
            return "no manifest: the write never finished"
        return "no manifest (not written by hf_llmkit, or its write never finished)"
    return check_manifest(folder, manifest, checksums=checksums)


def latest_complete_checkpoint(output_dir: str | os.PathLike, *, checksums: bool = True) -> str | None:
    """The newest `checkpoint-N` under `output_dir` that can be resumed from (complete, or unmanaged and loading).

    Use it instead of `transformers.trainer_utils.get_last_checkpoint`, which returns half-written folders.
    Returns None when there is none (start from scratch). Nothing is moved or deleted here.
    """
    for checkpoint in reversed(list_checkpoints(output_dir)):
        verdict = classify_checkpoint(checkpoint, checksums=checksums)
        if verdict.resumable:
            return str(checkpoint)
        logger.warning("skipping checkpoint %s", verdict.describe())
    return None
