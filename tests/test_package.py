"""Packaging and import contract: public names, idempotent registration, the callbacks/trainers mapping."""

from __future__ import annotations

import importlib
import subprocess
import sys
import zipfile

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


@pytest.mark.parametrize("order", ["peft,hf_llmkit", "hf_llmkit,peft", "transformers,hf_llmkit,hf_llmkit"])
def test_import_order_does_not_matter(order):
    """A fresh interpreter imports in the given order, then imports hf_llmkit again; nothing raises."""
    imports = "; ".join(f"import {name}" for name in order.split(","))
    code = f"{imports}; import importlib, hf_llmkit; importlib.reload(hf_llmkit); print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


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
