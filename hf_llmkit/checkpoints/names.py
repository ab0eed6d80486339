"""Every file and folder name the checkpoint lifecycle reads or writes, in one place.

The Trainer's own names (`trainer_state.json`, `checkpoint-N`) are transformers' and are spelled here once; the
rest are hf_llmkit's. Nothing else in the library spells them. `path_too_long` says, before any work, when a folder
given by the user cannot hold these names (a path over PATH_MAX, a name over NAME_MAX).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "ABANDONED_PREFIX",
    "CHECKPOINT_PREFIX",
    "CORRUPT_PREFIX",
    "INCOMPLETE_PREFIX",
    "JIT_INCOMPLETE_MARKER",
    "LOCK_FILE",
    "MANIFEST_NAME",
    "MODEL_FILE_PATTERNS",
    "OPTIMIZER_FILE_PATTERNS",
    "ROLLBACK_PREFIX",
    "RUN_RECORD",
    "TMP_MARK",
    "TRAINER_FILE_PATTERNS",
    "TRAINER_STATE",
    "WRITING_MARKER",
    "checkpoint_folder",
    "checkpoint_step",
    "list_checkpoints",
    "path_too_long",
    "shown_path",
]

# transformers' names
TRAINER_STATE = "trainer_state.json"
CHECKPOINT_PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR: folders are `checkpoint-N`
# written first and removed last by the Trainer's just-in-time checkpoint (`enable_jit_checkpoint`, on SIGTERM)
JIT_INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"
# what a full checkpoint holds besides the model, and a `save_only_model=True` one lacks (DeepSpeed: global_step*/)
OPTIMIZER_FILE_PATTERNS = ("optimizer*", "scheduler.pt", "global_step*")

# What a model / tokenizer / processor save writes at the top of a folder (the final model's manifest lists these,
# plus anything the save created or changed, and never run outputs such as results or logs).
MODEL_FILE_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template.*",
    "preprocessor_config.json",
    "processor_config.json",
)
# What the Trainer's `_save_checkpoint` writes into `checkpoint-N` besides the model (`fnmatch` patterns of paths
# relative to it: `*` also matches `/`): the state, optimizer, scheduler, scaler, RNG, a PEFT model's card and its
# named adapters' folders, DeepSpeed's and FSDP's sharded states.
TRAINER_FILE_PATTERNS = (
    *MODEL_FILE_PATTERNS,
    "*/adapter_model.*",
    "*/adapter_config.json",
    "README.md",
    "*/README.md",
    TRAINER_STATE,
    "training_args.bin",
    "optimizer*",
    "scheduler.pt",
    "scaler.pt",
    "rng_state*.pth",
    "latest",
    "zero_to_fp32.py",
    "global_step*/*",
    "pytorch_model_fsdp*",
)

# hf_llmkit's names inside a folder it writes
MANIFEST_NAME = "llmkit_manifest.json"  # written last: the folder is complete
WRITING_MARKER = ".llmkit-writing"  # written first: our write of the folder is in progress (or was cut short)
TMP_MARK = ".llmkit-tmp"  # suffix of folders/files being written atomically; never part of a manifest
RUN_RECORD = "llmkit_run.json"  # which run wrote a checkpoint (hf_llmkit.trainers.run_identity)
LOCK_FILE = ".llmkit-lock"  # in output_dir: the run that holds the folder (hf_llmkit.checkpoints.lock)

# prefixes of checkpoint folders moved out of the way (never matched by `checkpoint-*` globs)
ABANDONED_PREFIX = "abandoned-"
CORRUPT_PREFIX = "corrupt-"
INCOMPLETE_PREFIX = "incomplete-"
ROLLBACK_PREFIX = "llmkit-rollback"  # restart points of in-process rollbacks (hf_llmkit.trainers.recovery)

ROOM = 96  # bytes a folder's path must leave for what is written inside it ("/checkpoint-123456/...")
_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")


def checkpoint_folder(output_dir: str | os.PathLike, step: int) -> Path:
    """`output_dir/checkpoint-{step}`, the folder the Trainer writes at `step`."""
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}-{step}"


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step N of a `checkpoint-N` folder, or None for any other name."""
    match = _CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Every `checkpoint-N` folder under `output_dir`, oldest step first (complete or not)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in root.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    return [p for _, p in sorted(found)]


def _limit(folder: Path, name: str, default: int) -> int:
    for candidate in (folder, *folder.parents):
        try:
            return os.pathconf(candidate, name)
        except (OSError, ValueError):
            continue
    return default


def path_too_long(path: str | os.PathLike) -> str | None:
    """Why `path` is too long to be written into (a name over NAME_MAX, or a path leaving less than `ROOM` bytes
    below PATH_MAX), or None."""
    absolute = Path(os.path.abspath(path))
    name_max = _limit(absolute, "PC_NAME_MAX", 255)
    longest = max((len(os.fsencode(part)) for part in absolute.parts[1:]), default=0)
    if longest > name_max:
        return f"has a name of {longest} bytes, over the limit of {name_max} bytes per name"
    size, limit = len(os.fsencode(str(absolute))), _limit(absolute, "PC_PATH_MAX", 4096)
    if size + ROOM > limit:
        return f"is {size} bytes long, too close to the path limit of {limit} for what is written inside it"
    return None


def shown_path(path: str | os.PathLike, limit: int = 100) -> str:
    """`path` for a one-line message: its start and end around "..." when it is longer than `limit` characters."""
    text = str(path)
    return text if len(text) <= limit else f"{text[: limit // 2 - 2]}...{text[-(limit // 2 - 1) :]}"
