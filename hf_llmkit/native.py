"""The package's small C kernels: each a C source shipped with hf_llmkit, built once per machine with the C compiler
and loaded through ctypes (`CLibrary`).

A source is small and has no torch headers, so its build takes about a second (a torch C++ extension would take
minutes). The library lands in `<hf_llmkit cache>/kernels/` under a name that carries the source's hash and the
machine's architecture, is written to a private temporary and renamed into place, so concurrent processes never load
a half-written one. The file ends with the sha256 of what precedes it (a loader ignores bytes past its segments): a
cached library that is truncated or altered (a full disk, a copy cut short) is built again instead of loaded, since
loading one dies of SIGBUS with no message. It needs `cc` (or `$CC`); where there is none, or the build fails, or the
cache cannot be written, `library()` is None, the reason and its fix are logged once, and the caller takes its torch
path. Users: the packed DKM layers (`quantization/_lut_native.py`), DKM training's interval engine
(`quantization/engines/interval_kernel.py`) and the MoE experts' SwiGLU (`parallel/moe/swiglu_kernel.py`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from hf_llmkit.data.cache import temporary_sibling

logger = logging.getLogger(__name__)

P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int  # the argument types the kernels take
TRAILER = b"hf_llmkit-sha256:"  # then the 32-byte digest of everything before it: the end of every built library


def intact(path: Path) -> bool:
    """Whether the built library at `path` is whole: it ends with the digest of what precedes it."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    size = len(TRAILER) + 32
    body, end = data[:-size], data[-size:]
    return len(data) > size and end == TRAILER + hashlib.sha256(body).digest()


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


class CLibrary:
    """The C source `source` as a loaded library, built on first use.

    Args:
        source: the `.c` file, or several compiled as one translation unit in the order given (read once, at
            construction: a process builds and loads what it read, whatever edits follow; a missing file is an
            installation without it).
        stem: the built library's name prefix.
        what: how the one warning names it ("The DKM CPU kernel").
        fallback: what serves instead, for the warning ("packed layers use torch paths").
        declare: sets the functions' `argtypes` / `restype` on the loaded library.
        flags: compiler flags besides `-O3` (and `-fopenmp` where the compiler has it).
    """

    def __init__(
        self,
        source: Path | Sequence[Path],
        stem: str,
        what: str,
        fallback: str,
        declare: Callable[[ctypes.CDLL], None],
        flags: tuple[str, ...] = (),
    ):
        sources = (source,) if isinstance(source, Path) else tuple(source)
        missing = [s for s in sources if not s.is_file()]
        self.source = missing[0] if missing else sources[0]  # the file a missing-source error names
        self.stem, self.what, self.fallback, self.declare = stem, what, fallback, declare
        self.flags = flags
        self.text = b"" if missing else b"\n".join(s.read_bytes() for s in sources)
        self._lib: ctypes.CDLL | None = None
        self._error: str | None = None  # None: not tried yet

    def path(self) -> Path:
        """Where this machine's build lives (the name carries the source's hash)."""
        from hf_llmkit.data.corpus import default_cache_dir  # here: `python -m hf_llmkit.data.corpus` runs it once

        # TRAILER in the key: a build from before the trailer existed is not taken for a damaged one
        digest = hashlib.sha256(self.text + " ".join(self.flags).encode() + TRAILER).hexdigest()[:16]
        return default_cache_dir() / "kernels" / f"{self.stem}-{digest}-{sys.platform}-{platform.machine()}.so"

    def _build(self, target: Path) -> None:
        """Compile the source into `target` (with OpenMP where the compiler has it), atomically."""
        cc = compiler()
        if cc is None:
            raise RuntimeError("no C compiler found: install gcc, or set $CC")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = temporary_sibling(target)
            tmp.write_bytes(b"")
        except OSError as error:
            raise RuntimeError(
                f"its cache folder {target.parent} is not writable ({error.strerror or type(error).__name__}): make "
                "it writable, or set HF_LLMKIT_CACHE to a folder you can write to"
            ) from None
        base = [cc, "-O3", *self.flags, "-std=gnu11", "-shared", "-fPIC", "-x", "c", "-", "-o", str(tmp)]
        errors = ""
        for extra in (["-fopenmp"], []):
            try:
                done = subprocess.run([*base[:2], *extra, *base[2:]], input=self.text, capture_output=True)
            except OSError as error:  # $CC names nothing that runs
                tmp.unlink(missing_ok=True)
                raise RuntimeError(
                    f"the C compiler {cc} does not run ({error.strerror or type(error).__name__}): install gcc, or "
                    "set $CC to one that runs"
                ) from None
            if done.returncode == 0:
                with open(tmp, "ab") as built:
                    built.write(TRAILER + hashlib.sha256(tmp.read_bytes()).digest())
                os.replace(tmp, target)
                return
            errors = done.stderr.decode(errors="replace").strip()
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{cc} failed ({errors.splitlines()[0] if errors else 'no message'}): check $CC")

    def library(self) -> ctypes.CDLL | None:
        """The loaded library, built on first use; None (and one log line saying why) where it cannot be built."""
        if self._error is None:
            try:
                if not self.text:
                    raise RuntimeError(f"{self.source.name} is missing from this installation: reinstall hf_llmkit")
                if sys.byteorder != "little":
                    raise RuntimeError("the kernels read little-endian words")
                path = self.path()
                if path.is_file() and not intact(path):
                    logger.warning("%s: the cached %s is damaged (truncated or altered); building it again",
                                   self.what, path)  # fmt: skip
                if not intact(path):
                    self._build(path)
                lib = ctypes.CDLL(str(path))
                self.declare(lib)
                self._lib, self._error = lib, ""
            except Exception as error:  # noqa: BLE001 - no compiler, read-only cache, odd platform: torch paths serve
                self._error = str(error).strip().splitlines()[0] if str(error).strip() else "unknown error"
                logger.warning("%s is not available (%s); %s", self.what, self._error, self.fallback)
        return self._lib

    def built(self) -> bool:
        """Whether the library is loaded already (builds nothing; a plain attribute read, which `torch.compile` can
        trace)."""
        return self._lib is not None

    def unavailable_reason(self) -> str:
        """Why `library()` is None ('' when it loaded)."""
        self.library()
        return self._error or ""
