"""Publishing a cache folder so that concurrent ranks or runs never read a half-written one, and nothing a killed
write left behind stays.

Every write goes to a private temporary sibling named after the process (`<name>.tmp-<host>-<pid>[-<what>]`) and is
renamed into place when complete. A process killed half way leaves its temporary behind; the next build in the same
cache folder removes every temporary of this host whose process is gone (`remove_stale_temporaries`). Temporaries of
live processes, and of other hosts sharing the folder, are left alone.

`publish_once` keeps the first copy (cache entries are keyed by their content); `replace_folder` puts the new one in
place of an older folder (a run's output written again: the adapter's base, the merged model), with the same
temporaries.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

__all__ = ["not_a_folder", "publish_once", "remove_stale_temporaries", "replace_folder", "temporary_sibling"]

_TMP = ".tmp-"
_OWNER = re.compile(r"\.tmp-(?:(?P<host>.+)-)?(?P<pid>\d+)(?:-[a-z]+)?$")


def temporary_sibling(target: Path, what: str = "") -> Path:
    """`target`'s private temporary sibling for this process (`what` tells several apart)."""
    return target.with_name(f"{target.name}{_TMP}{socket.gethostname()}-{os.getpid()}" + (f"-{what}" if what else ""))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(folder: str | os.PathLike) -> list[str]:
    """Delete the temporaries under `folder` that a process of this host left when it died; returns their names."""
    removed, host = [], socket.gethostname()
    for path in Path(folder).glob(f"*{_TMP}*"):
        owner = _OWNER.search(path.name)
        if owner is None or (owner["host"] not in (None, host)) or _alive(int(owner["pid"])):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def publish_once(target: Path, write: Callable[[Path], None]) -> None:
    """Run `write(tmp)` into a private temporary folder, then rename it to `target`.

    The rename is atomic on one filesystem. When another process published `target` first, its copy is kept
    (cache entries are keyed by their content, so both copies are identical) and ours is removed. A failed write
    removes its temporary too.
    """
    tmp = temporary_sibling(target)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.exists():
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def not_a_folder(target: Path) -> str | None:
    """What stands where a folder `replace_folder` writes goes, when that is neither a folder nor nothing: "a file",
    "a symlink to ..." (a symlink may point at any folder, the user's own model too: it is never replaced)."""
    if target.is_symlink():
        return f"a symlink to {os.readlink(target)}"
    if target.exists() and not target.is_dir():
        return "a file"
    return None


def replace_folder(target: Path, write: Callable[[Path], None]) -> None:
    """Run `write(tmp)` into a private temporary folder, then put it in `target`'s place; an older `target` folder
    is renamed aside to a temporary first and removed after. A failed write removes its temporary and leaves
    `target` as it was; a process killed half way leaves only temporaries (`remove_stale_temporaries`).

    `target` must be a folder or absent (callers refuse anything else before any work): a file or a symlink there
    is a ValueError, never replaced and never written through."""
    tmp, old = temporary_sibling(target), temporary_sibling(target, "old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        if not_a_folder(target) is not None:
            raise ValueError(f"{target} is not a folder (a file or a symlink appeared there): remove it and run again")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replaced = target.is_dir()
    if replaced:
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        if replaced:
            os.replace(old, target)  # the older folder back where it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
