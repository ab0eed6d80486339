"""Real permission failures in tests that may run as root (root ignores permission bits).

`subprocess.run(..., **honour_permissions())` starts the child without the capabilities that let root write
anywhere (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, dropped from the bounding set before exec), so a folder with
mode 0o555 is unwritable for it as for any user. A non-root caller needs nothing.
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
