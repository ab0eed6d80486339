"""Real permission failures in tests that may run as root (root ignores permission bits).

`subprocess.run(..., **honour_permissions())` starts the child without the capabilities that let root write
anywhere (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, dropped from the bounding set before exec), so a folder with
mode 0o555 is unwritable for it as for any user; `give_up_override_capabilities()` does the same for
the calling process (a forked child). A non-root caller needs nothing.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


def _drop_override_capabilities() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def honour_permissions() -> dict[str, Any]:
    """`subprocess` keyword arguments that make permission bits apply to the child."""
    return {"preexec_fn": _drop_override_capabilities} if os.geteuid() == 0 else {}


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def give_up_override_capabilities() -> None:
    """For a process that does not exec (a forked child, tests/warm.py): permission bits apply to it from now on.

    Run as root, it drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from its own effective, permitted and inheritable
    sets (capset) and from the bounding set (what a later exec could regain); a non-root caller needs nothing.
    """
    if os.geteuid() != 0:
        return
    _drop_override_capabilities()
    libc = ctypes.CDLL(None, use_errno=True)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    mask = ~((1 << _CAP_DAC_OVERRIDE) | (1 << _CAP_DAC_READ_SEARCH)) & 0xFFFFFFFF
    data[0].effective &= mask
    data[0].permitted &= mask
    data[0].inheritable &= mask
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
