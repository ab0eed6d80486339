"""Packaging and import contract: public names, idempotent registration, the callbacks/trainers mapping."""

from __future__ import annotations

import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import hf_llmkit
from tests.conftest import REPO


def test_public_api_is_sorted_and_resolves():
    assert list(hf_llmkit.__all__) == sorted(hf_llmkit.__all__)
    for name in hf_llmkit.__all__:
        assert getattr(hf_llmkit, name) is not None, name


def test_mapped_subpackages_import_from_their_folders():
    import hf_llmkit.callbacks
    import hf_llmkit.trainers

    assert (REPO / "callbacks") in [p.parent for p in map(_path, [hf_llmkit.callbacks])]
    assert (REPO / "trainers") in [p.parent for p in map(_path, [hf_llmkit.trainers])]
    assert hf_llmkit.trainers.LLMKitTrainer.__module__ == "hf_llmkit.trainers.llmkit_trainer"


def _path(module):
    from pathlib import Path

    return Path(module.__file__).resolve()


def test_reimport_and_reload_are_idempotent():
    before = dict(vars(hf_llmkit))
    importlib.reload(hf_llmkit)
    importlib.reload(hf_llmkit)
    assert set(before) <= set(vars(hf_llmkit))


ORDERS = ["peft,hf_llmkit", "hf_llmkit,peft", "transformers,hf_llmkit,hf_llmkit"]

# One cold interpreter imports torch (beneath peft, transformers and hf_llmkit alike, and no party to their order),
# then forks a child per order: each child imports in its order, then imports hf_llmkit again. Its exit status and
# output go to files named after the order. (A cold interpreter per order spent a third of its 6-7 s on torch.)
FORK_PER_ORDER = """
import os, sys, torch
folder, orders = sys.argv[1], sys.argv[2:]
for order in orders:
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        out = os.open(os.path.join(folder, order + ".out"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(out, 1); os.dup2(out, 2)
        try:
            for name in order.split(","):
                __import__(name)
            import importlib, hf_llmkit
            importlib.reload(hf_llmkit)
            print("ok")
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    status = os.waitpid(pid, 0)[1]
    with open(os.path.join(folder, order + ".code"), "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
"""


@pytest.fixture(scope="module")
def import_orders(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("import_orders")
    proc = subprocess.run(
        [sys.executable, "-c", FORK_PER_ORDER, str(folder), *ORDERS], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


@pytest.mark.parametrize("order", ORDERS)
def test_import_order_does_not_matter(order, import_orders):
    """A fresh interpreter (torch imported, then forked) imports in the given order, then imports hf_llmkit again;
    nothing raises."""
    code, out = (import_orders / f"{order}.code").read_text(), (import_orders / f"{order}.out").read_text()
    assert code == "0" and out.strip().endswith("ok"), out[-3000:]


def test_regular_install_wheel_contains_mapped_packages(tmp_path):
    """A non-editable build puts callbacks/ and trainers/ under hf_llmkit/ in the wheel, and the
    C kernels' sources beside the modules that compile them."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-w", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("hf_llmkit-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(str(p.relative_to(REPO / "hf_llmkit")) for p in (REPO / "hf_llmkit").rglob("*.c"))
    assert "quantization/_lut_native.c" in sources and "_avx2_level.c" in sources  # every kernel's sources
    required_files = ("__init__.py", "callbacks/__init__.py", "trainers/__init__.py", *sources)
    for required in (f"hf_llmkit/{name}" for name in required_files):
        assert required in names
    assert not any(name.startswith(("callbacks/", "trainers/", "tests/", "examples/")) for name in names)
