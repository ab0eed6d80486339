"""Publishing a cache folder so that concurrent ranks or runs never read a half-written one."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def publish_once(target: Path, write: Callable[[Path], None]) -> None:
    """Run `write(tmp)` into a private temporary folder, then rename it to `target`.

    The rename is atomic on one filesystem. When another process published `target` first, its copy is kept
    (cache entries are keyed by their content, so both copies are identical) and ours is removed.
    """
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
