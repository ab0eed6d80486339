"""The main jobs' setting of the C allocator: freed large blocks are kept for reuse instead of unmapped.

glibc hands every block above its mmap threshold back to the kernel when it is freed, and that threshold adapts up
to 32 MiB at most. A training step that allocates weight-sized temporaries larger than that (DKM's soft assignment
of a 2048 x 5632 matrix: float32 copies of 46 MB) gets fresh pages for each of them, every step, and the kernel
zeroes and maps them one page fault at a time (over a third of a 1B Llama's DKM steps on 2 CPU cores). The jobs
raise the threshold and the heap's trim threshold to 1 GiB, so those blocks come back from the heap (what that
costs in peak resident memory and saves in time: benchmarks/dkm_quality.py `--only job`, docs/dkm.md). A
`GLIBC_TUNABLES` that sets any malloc tunable, or glibc's older variables for the two thresholds
(`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`), is the user's own choice and is left alone; other C libraries
are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

KEEP_BELOW = 1 << 30  # blocks up to 1 GiB come from the heap and return to it
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_USER_THRESHOLDS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # glibc reads them at start-up


def keep_freed_blocks() -> bool:
    """Raise glibc's mmap and trim thresholds to `KEEP_BELOW`; whether it did (False: not glibc, or the user set
    malloc tunables)."""
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(os.environ.get(n) for n in _USER_THRESHOLDS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl, macOS: their allocators differ)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BELOW)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_BELOW))
