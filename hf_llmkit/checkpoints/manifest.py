"""Checkpoint manifests and write markers: what a folder we wrote holds, and whether our write of it finished.

A folder hf_llmkit writes (a `checkpoint-N`, a final model folder, an adapter folder) goes through two stages:

1. **Writing.** Before its first byte, every writer creates the marker `.llmkit-writing` in the folder. A folder
   with the marker and no valid manifest is "our write was interrupted": the only kind of folder that may be
   deleted without a second thought.
2. **Complete.** Once every writer has finished, `llmkit_manifest.json` is written last and atomically (temporary
   file, fsync, rename): every file with its size and checksum. Then the marker is removed.

Manifest entries are relative paths confined to their folder: an absolute path, a `..` component or a symlink that
leaves the folder makes the manifest invalid (`check_manifest`). Which folders are complete, interrupted,
foreign or corrupt is decided in `hf_llmkit.checkpoints.status`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from hf_llmkit.checkpoints.names import MANIFEST_NAME, TMP_MARK, WRITING_MARKER, checkpoint_step

MANIFEST_FORMAT = 1
_CHUNK = 4 << 20
_NOT_PAYLOAD = {MANIFEST_NAME, WRITING_MARKER}

__all__ = [
    "check_manifest",
    "clear_writing",
    "is_writing",
    "mark_writing",
    "payload_files",
    "read_manifest",
    "write_manifest",
]


# -- write markers ------------------------------------------------------------------------------------------
def mark_writing(folder: str | os.PathLike) -> Path:
    """Create `folder` (if needed) and its writing marker; call before the first byte of a write, on every writer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / WRITING_MARKER
    with open(marker, "a", encoding="utf-8") as handle:
        handle.write(f"{os.getpid()}\n")
    return marker


def clear_writing(folder: str | os.PathLike) -> None:
    """Remove the writing marker (after the manifest, or once every writer has finished)."""
    (Path(folder) / WRITING_MARKER).unlink(missing_ok=True)


def is_writing(folder: str | os.PathLike) -> bool:
    return (Path(folder) / WRITING_MARKER).is_file()


# -- writing manifests -------------------------------------------------------------------------------------
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


def payload_files(folder: Path, *, recursive: bool = True) -> list[Path]:
    """The regular files a manifest of `folder` covers (no symlinks, temporaries, marker or manifest)."""
    files = []
    for dirpath, dirnames, filenames in os.walk(folder):  # never follows symlinked folders
        dirnames[:] = sorted(d for d in dirnames if TMP_MARK not in d) if recursive else []
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name not in _NOT_PAYLOAD and TMP_MARK not in name and not path.is_symlink():
                files.append(path)
    return files


def _describe(paths: list[Path], checksum: str | None, fsync: bool) -> list[dict]:
    def describe(path: Path) -> dict:
        entry: dict = {"size": path.stat().st_size}
        if checksum is not None:
            entry[checksum] = _digest(path, checksum, fsync)
        elif fsync:
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        return entry

    # hashlib and fsync release the GIL: a few threads overlap hashing one file with flushing another.
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1, len(paths)))) as pool:
        return list(pool.map(describe, paths))


def _replace_manifest(folder: Path, manifest: dict, fsync: bool) -> Path:
    tmp = folder / (MANIFEST_NAME + TMP_MARK)
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.flush()
        if fsync:
            os.fsync(handle.fileno())
    os.replace(tmp, folder / MANIFEST_NAME)
    if fsync:
        _fsync_dir(folder)
    return folder / MANIFEST_NAME


def write_manifest(
    folder: str | os.PathLike,
    *,
    checksum: str | None = "sha256",
    fsync: bool = True,
    extra: dict | None = None,
    files: Iterable[str | os.PathLike] | None = None,
) -> Path:
    """List the files of `folder` with their sizes (and checksums) and write the manifest atomically, last.

    Call it once every writer has finished. `files` restricts the manifest to these paths (relative to `folder`;
    default: every file below it). `checksum` is a `hashlib` algorithm name, or None to record sizes only; with
    `fsync` the files and the manifest reach stable storage first. The writing marker is removed afterwards.
    """
    folder = Path(folder)
    if checksum is not None and checksum not in hashlib.algorithms_available:
        raise ValueError(f"checksum {checksum!r} is not a hashlib algorithm; use 'sha256', 'blake2b' or None")
    paths = payload_files(folder) if files is None else [folder / name for name in files]
    entries = _describe(paths, checksum, fsync)
    listed = {path.relative_to(folder).as_posix(): entry for path, entry in zip(paths, entries)}
    manifest = {"format": MANIFEST_FORMAT, "step": checkpoint_step(folder), "checksum": checksum}
    manifest.update(extra or {})
    manifest.update(created=time.time(), files=listed)
    path = _replace_manifest(folder, manifest, fsync)
    clear_writing(folder)
    return path


# -- reading and checking manifests ------------------------------------------------------------------------
def read_manifest(folder: str | os.PathLike) -> dict | None:
    """The parsed manifest of `folder`, None when there is none; raises ValueError when it is unreadable."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"unreadable manifest ({err})") from err
    if not isinstance(manifest, dict):
        raise ValueError("unreadable manifest (not a JSON object)")
    return manifest


def _confined(folder: Path, name: str) -> Path | None:
    """`folder/name` when `name` is a relative path that stays inside `folder` (symlinks resolved), else None."""
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        return None
    relative = PurePosixPath(name)
    if relative.is_absolute() or any(part in ("..", "") for part in relative.parts):
        return None
    path = folder / relative
    try:
        resolved, root = path.resolve(), folder.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        return None
    return path if resolved == root or root in resolved.parents else None


def check_manifest(folder: str | os.PathLike, manifest: dict, *, checksums: bool = True) -> str | None:
    """None when every entry of `manifest` matches `folder`, else what differs (first problem found)."""
    folder = Path(folder)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "empty manifest" if isinstance(files, dict) else "unreadable manifest (no 'files' table)"
    algorithm = manifest.get("checksum") if checksums else None
    if algorithm is not None and algorithm not in hashlib.algorithms_available:
        return f"the manifest names an unknown checksum {algorithm!r}"
    for name, entry in files.items():
        path = _confined(folder, name)
        if path is None:
            return f"the manifest lists {name!r}, outside the folder"
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
            return f"the manifest entry of {name} has no size"
        try:
            size = path.stat().st_size
        except OSError:
            return f"missing file {name}"
        if size != entry["size"]:
            return f"{name} has {size} bytes, the manifest says {entry['size']}"
        if algorithm is None:
            continue
        try:
            digest = _digest(path, algorithm, fsync=False)
        except OSError as err:
            return f"cannot read {name} ({err.strerror or err})"
        if digest != entry.get(algorithm):
            return f"{name} fails its {algorithm} checksum"
    return None
