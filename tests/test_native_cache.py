"""The built C kernels' cache (`hf_llmkit.native`, issue 46): a truncated cached library made every process that
loaded it die of SIGBUS (exit status 135) with no message, until the file was deleted; now a damaged one is built
again, said in one line. A cache that cannot be written names that, not a missing compiler.

Each probe runs in a process of its own, forked from this one (a new interpreter would spend 6-7 s of CPU importing
hf_llmkit): a library loaded, or a damaged one, never touches the test process, and a probe that dies shows as its
signal."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import tempfile
import traceback
from pathlib import Path

from hf_llmkit.native import CLibrary
from tests.cli.permissions import give_up_override_capabilities


def _in_a_forked_process(fn, *args) -> tuple[int, str, str]:
    """`fn(*args)` in a forked child: its exit status (minus the signal that killed it), stdout and stderr (the log
    lines, as `%(message)s`, WARNING and above)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the child: ends in os._exit, never back in pytest
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)  # noqa: SIM115
                handler = logging.StreamHandler(sys.stderr)
                handler.setFormatter(logging.Formatter("%(message)s"))
                logging.root.handlers, logging.root.level = [handler], logging.WARNING
                fn(*args)
                code = 0
            except BaseException:  # noqa: BLE001 - reported on the child's stderr
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()


def _probe(source: Path, cache: Path, honour_permissions: bool = False) -> None:
    """A tiny library through the same class as the real kernels; prints what it computes and where it lives."""
    if honour_permissions:
        give_up_override_capabilities()
    os.environ["HF_LLMKIT_CACHE"] = str(cache)

    def declare(lib):
        lib.answer.restype = ctypes.c_int

    kernel = CLibrary(source, "probe", "The probe kernel", "the torch path serves", declare)
    lib = kernel.library()
    print(lib.answer() if lib is not None else "NONE", kernel.path())


def _run_probe(tmp_path: Path, cache: Path, honour_permissions: bool = False) -> tuple[int, str, str]:
    source = tmp_path / "probe.c"
    source.write_text("int answer(void) { return 42; }\n")
    return _in_a_forked_process(_probe, source, cache, honour_permissions)


def test_a_truncated_cached_library_is_built_again_instead_of_killing_the_process(tmp_path):
    code, stdout, stderr = _run_probe(tmp_path, tmp_path / "cache")
    assert code == 0 and stdout.startswith("42 "), stderr[-2000:]
    built = Path(stdout.split()[1])
    whole = built.read_bytes()
    built.write_bytes(whole[: len(whole) // 2])  # a copy cut short, a full disk
    code, stdout, stderr = _run_probe(tmp_path, tmp_path / "cache")
    assert code == 0 and stdout.startswith("42 "), (code, stderr[-2000:])
    [line] = [line for line in stderr.splitlines() if "probe" in line.lower()]
    assert line == f"The probe kernel: the cached {built} is damaged (truncated or altered); building it again"
    assert built.read_bytes() == whole  # the same build, whole again
    code, stdout, stderr = _run_probe(tmp_path, tmp_path / "cache")
    assert code == 0 and stderr.strip() == ""  # an intact one loads without a word


def test_an_unwritable_cache_is_named_with_its_fix(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o555)
    try:
        code, stdout, stderr = _run_probe(tmp_path, cache, honour_permissions=True)
    finally:
        cache.chmod(0o755)
    assert code == 0 and stdout.startswith("NONE"), stderr[-2000:]
    [line] = stderr.strip().splitlines()
    assert line.startswith(f"The probe kernel is not available (its cache folder {cache / 'kernels'} is not writable")
    assert "set HF_LLMKIT_CACHE to a folder you can write to" in line and "gcc" not in line
