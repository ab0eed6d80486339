"""Checkpoint manifests: a checkpoint counts only once its manifest (files, sizes, checksums) is written, last.

The HF Trainer writes `checkpoint-N/` file by file and `transformers.trainer_utils.get_last_checkpoint` returns the
highest-numbered folder, complete or not: a kill in the middle of a write leaves a folder every later resume trips
over. Here a checkpoint is *complete* only when `llmkit_manifest.json` exists and every file it lists is present
with the recorded size (and, when verifying deeply, the recorded checksum). The manifest is written atomically
(temporary file, fsync, rename) after every rank has finished writing, so its presence proves the rest.

Example:
    ```python
    from hf_llmkit.callbacks import latest_complete_checkpoint

    trainer.train(resume_from_checkpoint=latest_complete_checkpoint("outputs/run"))
    ```
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

MANIFEST_NAME = "llmkit_manifest.json"
MANIFEST_FORMAT = 1
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_TMP_MARK = ".llmkit-tmp"  # suffix of folders/files being written atomically; never part of a manifest
_CHUNK = 4 << 20

__all__ = [
    "MANIFEST_NAME",
    "add_to_manifest",
    "checkpoint_step",
    "latest_complete_checkpoint",
    "list_checkpoints",
    "remove_checkpoint",
    "rotate_checkpoints",
    "verify_checkpoint",
    "write_manifest",
]


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step N of a `checkpoint-N` folder, or None for any other name."""
    match = _CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Every `checkpoint-N` folder under `output_dir`, oldest step first (complete or not)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return [p for _, p in sorted(found)]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _digest(path: Path, algorithm: str, fsync: bool) -> str:
    hasher = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
        if fsync:
            os.fsync(handle.fileno())  # the data must be durable before the manifest that vouches for it
    return hasher.hexdigest()


def _payload_files(checkpoint: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(checkpoint):
        dirnames[:] = sorted(d for d in dirnames if _TMP_MARK not in d)
        for name in sorted(filenames):
            if name != MANIFEST_NAME and _TMP_MARK not in name:
                files.append(Path(dirpath) / name)
    return files


def write_manifest(
    checkpoint: str | os.PathLike,
    *,
    checksum: str | None = "sha256",
    fsync: bool = True,
    extra: dict | None = None,
) -> Path:
    """List every file of `checkpoint` with its size (and checksum) and write the manifest atomically, last.

    Call it once every rank has finished writing. `checksum` is a `hashlib` algorithm name, or None to record
    sizes only; with `fsync` the files and the manifest are flushed to stable storage first.
    """
    checkpoint = Path(checkpoint)
    if checksum is not None and checksum not in hashlib.algorithms_available:
        raise ValueError(f"checksum {checksum!r} is not a hashlib algorithm; use 'sha256', 'blake2b' or None")

    def describe(path: Path) -> dict:
        entry: dict = {"size": path.stat().st_size}
        if checksum is not None:
            entry[checksum] = _digest(path, checksum, fsync)
        elif fsync:
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        return entry

    paths = _payload_files(checkpoint)
    # hashlib and fsync release the GIL: a few threads overlap hashing one file with flushing another.
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1, len(paths)))) as pool:
        entries = list(pool.map(describe, paths))
    files = {path.relative_to(checkpoint).as_posix(): entry for path, entry in zip(paths, entries)}
    manifest = {"format": MANIFEST_FORMAT, "step": checkpoint_step(checkpoint), "checksum": checksum}
    manifest.update(extra or {})
    manifest.update(created=time.time(), files=files)
    tmp = checkpoint / (MANIFEST_NAME + _TMP_MARK)
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.flush()
        if fsync:
            os.fsync(handle.fileno())
    os.replace(tmp, checkpoint / MANIFEST_NAME)
    if fsync:
        _fsync_dir(checkpoint)
    return checkpoint / MANIFEST_NAME


def add_to_manifest(checkpoint: str | os.PathLike, subfolder: str, *, fsync: bool = True) -> bool:
    """Record the files of `checkpoint/subfolder` in an existing manifest (atomically); False if there is none.

    Lets a writer that runs after the manifest (another callback's `on_save`) keep the checkpoint self-describing.
    """
    checkpoint = Path(checkpoint)
    path = checkpoint / MANIFEST_NAME
    if not path.is_file():
        return False
    manifest = json.loads(path.read_text(encoding="utf-8"))
    algorithm = manifest.get("checksum")
    for file in _payload_files(checkpoint / subfolder):
        entry: dict = {"size": file.stat().st_size}
        if algorithm is not None:
            entry[algorithm] = _digest(file, algorithm, fsync)
        manifest["files"][file.relative_to(checkpoint).as_posix()] = entry
    tmp = checkpoint / (MANIFEST_NAME + _TMP_MARK)
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)
    return True


def verify_checkpoint(checkpoint: str | os.PathLike, *, checksums: bool = True) -> str | None:
    """None when `checkpoint` is complete, else the reason it is not (missing manifest, missing/short/corrupt file)."""
    checkpoint = Path(checkpoint)
    path = checkpoint / MANIFEST_NAME
    if not path.is_file():
        return "no manifest (the write never finished)"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as err:
        return f"unreadable manifest ({err})"
    if not files:
        return "empty manifest"
    algorithm = manifest.get("checksum") if checksums else None
    for name, entry in files.items():
        file = checkpoint / name
        try:
            size = file.stat().st_size
        except OSError:
            return f"missing file {name}"
        if size != entry["size"]:
            return f"{name} has {size} bytes, the manifest says {entry['size']}"
        if algorithm is not None and _digest(file, algorithm, fsync=False) != entry.get(algorithm):
            return f"{name} fails its {algorithm} checksum"
    return None


def latest_complete_checkpoint(output_dir: str | os.PathLike, *, checksums: bool = True) -> str | None:
    """The newest `checkpoint-N` under `output_dir` whose manifest verifies; incomplete/corrupt ones are skipped.

    Use it instead of `transformers.trainer_utils.get_last_checkpoint`, which returns half-written folders.
    Returns None when there is no complete checkpoint (start from scratch).
    """
    for checkpoint in reversed(list_checkpoints(output_dir)):
        reason = verify_checkpoint(checkpoint, checksums=checksums)
        if reason is None:
            return str(checkpoint)
        logger.warning("skipping checkpoint %s: %s", checkpoint, reason)
    return None


def remove_checkpoint(checkpoint: str | os.PathLike) -> None:
    """Delete a checkpoint folder, manifest first, so a deletion cut short never leaves a 'complete' fragment."""
    checkpoint = Path(checkpoint)
    (checkpoint / MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(checkpoint, ignore_errors=True)


def rotate_checkpoints(
    output_dir: str | os.PathLike, save_total_limit: int | None, *, keep: tuple[str | os.PathLike, ...] = ()
) -> list[Path]:
    """Apply `save_total_limit` to complete checkpoints; returns the folders deleted.

    Never deletes the newest complete checkpoint (nor any in `keep`, e.g. the best model); incomplete checkpoints
    older than the newest complete one can never be resumed from and are deleted too. Incomplete checkpoints newer
    than it are left alone (a write may be in progress).
    """
    checkpoints = list_checkpoints(output_dir)
    complete = [c for c in checkpoints if verify_checkpoint(c, checksums=False) is None]
    if not complete:
        return []
    newest = complete[-1]
    newest_step = checkpoint_step(newest)
    protected = {newest.resolve(), *(Path(k).resolve() for k in keep if k)}
    doomed = [c for c in checkpoints if c not in complete and checkpoint_step(c) < newest_step]
    if save_total_limit is not None and save_total_limit > 0:
        excess = len(complete) - max(save_total_limit, 1)
        for checkpoint in complete:
            if excess <= 0:
                break
            if checkpoint.resolve() not in protected:
                doomed.append(checkpoint)
                excess -= 1
    for checkpoint in doomed:
        logger.info("deleting checkpoint %s (save_total_limit / incomplete)", checkpoint)
        remove_checkpoint(checkpoint)
    return doomed
