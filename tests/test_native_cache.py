"""The built C kernels' cache (`hf_llmkit.native`, issue 46): a truncated cached library made every process that
loaded it die of SIGBUS (exit status 135) with no message, until the file was deleted; now a damaged one is built
again, said in one line. A cache that cannot be written names that, not a missing compiler."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.cli.permissions import honour_permissions

ROOT = Path(__file__).resolve().parents[1]
# A tiny library through the same class as the real kernels; prints what it computes and where it lives.
PROBE = textwrap.dedent(
    """
    import ctypes, logging, sys
    from pathlib import Path
    from hf_llmkit.native import CLibrary
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    source = Path(sys.argv[1])

    def declare(lib):
        lib.answer.restype = ctypes.c_int

    kernel = CLibrary(source, "probe", "The probe kernel", "the torch path serves", declare)
    lib = kernel.library()
    print(lib.answer() if lib is not None else "NONE", kernel.path())
    """
)


def _probe(tmp_path: Path, cache: Path, **kwargs) -> subprocess.CompletedProcess:
    source = tmp_path / "probe.c"
    source.write_text("int answer(void) { return 42; }\n")
    env = dict(os.environ, HF_LLMKIT_CACHE=str(cache))
    return subprocess.run([sys.executable, "-c", PROBE, str(source)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300, **kwargs)  # fmt: skip


def test_a_truncated_cached_library_is_built_again_instead_of_killing_the_process(tmp_path):
    first = _probe(tmp_path, tmp_path / "cache")
    assert first.returncode == 0 and first.stdout.startswith("42 "), first.stderr[-2000:]
    built = Path(first.stdout.split()[1])
    whole = built.read_bytes()
    built.write_bytes(whole[: len(whole) // 2])  # a copy cut short, a full disk
    again = _probe(tmp_path, tmp_path / "cache")
    assert again.returncode == 0 and again.stdout.startswith("42 "), (again.returncode, again.stderr[-2000:])
    [line] = [line for line in again.stderr.splitlines() if "probe" in line.lower()]
    assert line == f"The probe kernel: the cached {built} is damaged (truncated or altered); building it again"
    assert built.read_bytes() == whole  # the same build, whole again
    quiet = _probe(tmp_path, tmp_path / "cache")
    assert quiet.returncode == 0 and quiet.stderr.strip() == ""  # an intact one loads without a word


def test_an_unwritable_cache_is_named_with_its_fix(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o555)
    try:
        proc = _probe(tmp_path, cache, **honour_permissions())
    finally:
        cache.chmod(0o755)
    assert proc.returncode == 0 and proc.stdout.startswith("NONE"), proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"The probe kernel is not available (its cache folder {cache / 'kernels'} is not writable")
    assert "set HF_LLMKIT_CACHE to a folder you can write to" in line and "gcc" not in line
