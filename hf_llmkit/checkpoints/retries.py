"""Failed writes: which are worth retrying, the retry loop every rank runs together, and the one line a user reads.

torch and safetensors do not always raise `OSError` when a write fails: a full disk surfaces as
`RuntimeError: [enforce fail at inline_container.cc] unexpected pos ...`, `... basic_ios::clear: iostream error`
or `PytorchStreamWriter failed writing file`, and safetensors as `SafetensorError: ... I/O error: ... (os error 28)`.
`describe_write_error` recognises all of them and says what happened in words (disk full, no permission,
read-only filesystem, file size limit), with the free space where it matters.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hf_llmkit.checkpoints.collectives import any_rank

logger = logging.getLogger(__name__)

__all__ = ["describe_write_error", "is_transient_io_error", "save_with_retries", "write_errno"]

# Errors that another attempt a second later will not fix.
_PERMANENT_ERRNOS = {
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.EISDIR,
    errno.ENOTDIR,
    errno.ENAMETOOLONG,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EFBIG,
}
_STREAM_ERRORS = ("PytorchStreamWriter", "file write failed", "iostream error", "unexpected pos")
_OS_ERROR_IN_TEXT = re.compile(r"(?:os error|\[?errno) (\d+)", re.IGNORECASE)  # safetensors, pyarrow
_WORDS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only filesystem",
    errno.EFBIG: "file too large (a file size limit, e.g. ulimit -f)",
    errno.EIO: "input/output error",
    errno.ENAMETOOLONG: "a path or a name in it is too long (the limits are PATH_MAX and NAME_MAX, usually 4096 and "
    "255 bytes)",
}


def write_errno(err: BaseException) -> int | None:
    """The errno behind a failed write, also when torch or safetensors wrapped it (None when it is not known)."""
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno
    match = _OS_ERROR_IN_TEXT.search(str(err))
    return int(match.group(1)) if match else None


def _is_stream_error(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, RuntimeError) and any(marker in text for marker in _STREAM_ERRORS)


def is_transient_io_error(err: BaseException) -> bool:
    """Whether a failed write is worth retrying (I/O hiccups; not a full disk, a permission or a path mistake)."""
    code = write_errno(err)
    if code is not None:
        return code not in _PERMANENT_ERRNOS
    return _is_stream_error(err)  # torch hides the errno: retry, and say "disk full?" if it keeps failing


def describe_write_error(err: BaseException, folder: str | os.PathLike) -> str | None:
    """One line saying why writing into `folder` failed, or None when `err` is not a write failure."""
    code = write_errno(err)
    if code is None and not _is_stream_error(err):
        return None
    free = _free_space(Path(folder))
    if code is None:
        limit = _file_size_limit()
        limit = f", or a file reached the file size limit ({limit} bytes, ulimit -f)" if limit else ""
        return f"a write failed ({' '.join(str(err).split())}); the disk may be full ({free} free){limit}"
    words = _WORDS.get(code, os.strerror(code).lower())
    filename = getattr(err, "filename", None)
    if filename and Path(filename) != Path(folder):
        words = f"{words} ({filename})"
    return f"{words}, {free} free" if code in (errno.ENOSPC, errno.EDQUOT) else words


def _file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _free_space(folder: Path) -> str:
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return "unknown space"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if free < 1024 or unit == "GiB":
            return f"{free:.0f} {unit}" if unit == "bytes" else f"{free:.1f} {unit}"
        free /= 1024
    return f"{free:.1f} TiB"


def save_with_retries(
    save: Callable[[], Any],
    *,
    retries: int,
    delay: float,
    device: torch.device | str = "cpu",
    what: str = "save",
    collective: bool = True,
) -> None:
    """Run `save()`; on a transient I/O error on any rank, every rank runs it again (backoff `delay * 2**k`).

    With `collective` every rank must call this together (they agree on success); without it only this process
    retries (for writes only the main process makes). A permanent error is raised at once, on every rank.
    """
    for attempt in range(retries + 1):
        error: BaseException | None = None
        try:
            save()
        except Exception as err:
            error = err
        transient = error is None or is_transient_io_error(error)
        if collective and any_rank(not transient, device):
            if error is not None and not transient:
                raise error
            raise OSError(errno.EIO, f"{what} failed on another rank")
        if not collective and not transient:
            raise error
        failed = any_rank(error is not None, device) if collective else error is not None
        if not failed:
            if attempt:
                logger.warning("%s succeeded on attempt %d", what, attempt + 1)
            return
        if attempt == retries:
            if error is not None:
                raise error
            raise OSError(errno.EIO, f"{what} failed on another rank after {retries + 1} attempts")
        wait = delay * 2**attempt
        logger.warning(
            "%s failed (%s); retrying in %.1fs (%d/%d)", what, error or "another rank", wait, attempt + 1, retries
        )
        time.sleep(wait)
