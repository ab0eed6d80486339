"""One run per output folder: an exclusive advisory lock on `output_dir` held for the run's whole life.

The lock is `flock(2)` on `output_dir/.llmkit-lock`, taken by the main process only (on several ranks and nodes,
one holder) and released by the kernel when the process dies, however it dies: a stale lock of a dead process is
taken over without a word. The file records who holds it (host, pid, start time, command), so a second run into a
locked folder stops before any work with one line naming the holder (`OutputDirInUse`, exit status 2). Within one
process the lock is shared (a notebook that builds several trainers on one folder, the main job and its trainer).

A folder whose filesystem cannot lock (some network filesystems answer ENOLCK / EOPNOTSUPP) is used without a lock,
with a warning; a folder that cannot be created or written is left to the writability checks that follow.

    handle = hold_output_dir("outputs/run", main=True)   # raises OutputDirInUse when another live run holds it
    ...
    handle.release()                                      # or let the process end
    handle.release(clean=True)                            # a run rejected before any work: no folder left behind
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from hf_llmkit.checkpoints.collectives import any_rank
from hf_llmkit.checkpoints.endings import ResumeError
from hf_llmkit.checkpoints.names import LOCK_FILE

logger = logging.getLogger(__name__)

__all__ = ["OutputDirInUse", "OutputDirLock", "hold_output_dir", "lock_holder"]

_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


class OutputDirInUse(ResumeError):
    """Another live run holds the output folder; the message names it (host, pid, start time) and what to do."""


@dataclass
class _Held:
    fd: int
    pid: int  # the process that took it (a forked child does not hold it)
    created: list[Path]  # the folders taking the lock created, outermost first
    refs: int = 0


_HELD: dict[str, _Held] = {}


class OutputDirLock:
    """A share of this process's lock on one output folder; `release()` gives it back (also when collected)."""

    def __init__(self, key: str | None):
        self.key = key
        self._finalizer = weakref.finalize(self, _release, key) if key is not None else None

    @property
    def held(self) -> bool:
        return self.key is not None and self._finalizer is not None and self._finalizer.alive

    def release(self, *, clean: bool = False) -> None:
        """Give this share back; `clean` (a run that stops before any work): the last share also removes the lock
        file and the folders taking the lock created, when nothing else was written into them."""
        if self._finalizer is not None and self._finalizer.detach() is not None:
            _release(self.key, clean=clean)


def _release(key: str, clean: bool = False) -> None:
    held = _HELD.get(key)
    if held is None or held.pid != os.getpid():
        return
    held.refs -= 1
    if held.refs <= 0:
        del _HELD[key]
        if clean:
            with contextlib.suppress(OSError):
                os.unlink(Path(key) / LOCK_FILE)
        os.close(held.fd)  # drops the flock
        for folder in reversed(held.created if clean else []):
            with contextlib.suppress(OSError):  # not empty: something else lives there
                folder.rmdir()


def lock_holder(output_dir: str | os.PathLike) -> dict | None:
    """What the lock file of `output_dir` says about its holder (None when there is none or it is unreadable)."""
    try:
        info = json.loads((Path(output_dir) / LOCK_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _describe(info: dict | None) -> str:
    if not info:
        return "holder unknown"
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, started {when}"


def _try_lock(folder: Path) -> tuple[int | None, str | None]:
    """(fd holding the lock, None), (None, "busy") or (None, None) when no lock can be taken here."""
    import fcntl

    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None, None  # not a writable folder: the writability checks that follow say so
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None, "busy"
        if err.errno in _NO_LOCKS:
            logger.warning("%s cannot be locked (%s): a second run into it would not be stopped", folder, err)
        return None, None
    info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "command": sys.argv[:8]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    return fd, None


def hold_output_dir(output_dir: str | os.PathLike, *, main: bool = True, device="cpu") -> OutputDirLock:
    """Take this run's lock on `output_dir` (shared within the process); only `main` locks, every rank agrees.

    Raises `OutputDirInUse` (one line, exit status 2; the caller logs it) on every rank when another live process
    holds it.
    """
    folder = Path(output_dir)
    key = None
    busy = False
    if main:
        key = os.path.realpath(folder)
        held = _HELD.get(key)
        if held is not None and held.pid != os.getpid():  # inherited through fork: not ours
            _HELD.pop(key)
            os.close(held.fd)
            held = None
        if held is None:
            created = [path for path in (*reversed(folder.absolute().parents), folder.absolute()) if not path.exists()]
            fd, problem = _try_lock(folder)
            busy = problem == "busy"
            if fd is not None:
                held = _HELD[key] = _Held(fd=fd, pid=os.getpid(), created=created)
        if held is not None:
            held.refs += 1
        else:
            key = None
    if any_rank(busy, device):
        holder = _describe(lock_holder(folder)) if main else "see rank 0's message"
        raise OutputDirInUse(
            f"output_dir {folder} is in use by another run ({holder}); let that run finish or stop it, or pass "
            "another --output_dir"
        )
    return OutputDirLock(key)
