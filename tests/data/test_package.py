"""hf_llmkit.data: one package for the data path; its names resolve from the package and `python -m` runs its
modules without runpy's "found in sys.modules" warning (the package imports none of them eagerly)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import hf_llmkit.data as data


def test_every_listed_name_is_its_modules_object():
    assert data.__all__ == sorted(data.__all__)
    for name in data.__all__:
        module = importlib.import_module(f"hf_llmkit.data.{data._MODULE_OF[name]}")
        assert getattr(data, name) is getattr(module, name), name
        assert name in module.__all__, name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'lm_data'"):
        data.lm_data  # noqa: B018


@pytest.mark.parametrize("module", ["corpus", "instructions"])
def test_python_dash_m_runs_the_module_once(module, tmp_path):
    target = tmp_path / ("texts" if module == "corpus" else "instructions.jsonl")
    proc = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", f"hf_llmkit.data.{module}", str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "RuntimeWarning" not in proc.stderr, proc.stderr[-2000:]
    assert target.exists()
