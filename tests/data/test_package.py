"""hf_llmkit.data: one package for the data path; its names resolve from the package and `python -m` runs its
modules without runpy's "found in sys.modules" warning (the package imports none of them eagerly)."""

from __future__ import annotations

import importlib
import sys

import pytest

import hf_llmkit.data as data
from tests import warm


def test_every_listed_name_is_its_modules_object():
    assert data.__all__ == sorted(data.__all__)
    for name in data.__all__:
        module = importlib.import_module(f"hf_llmkit.data.{data._MODULE_OF[name]}")
        assert getattr(data, name) is getattr(module, name), name
        assert name in module.__all__, name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'lm_data'"):
        data.lm_data  # noqa: B018


def _run_as_main(module: str, target: str) -> None:
    """`python -W error::RuntimeWarning -m hf_llmkit.data.<module> TARGET` in a child of the warm interpreter: every
    hf_llmkit module is dropped first, so importing the package runs again as in a fresh interpreter (what decides
    the warning: whether `import hf_llmkit.data` already loaded the module); the third-party stack stays imported."""
    import runpy
    import warnings

    for name in [name for name in sys.modules if name == "hf_llmkit" or name.startswith("hf_llmkit.")]:
        del sys.modules[name]
    warnings.simplefilter("error", RuntimeWarning)
    sys.argv = [module, target]
    runpy.run_module(f"hf_llmkit.data.{module}", run_name="__main__", alter_sys=True)


@pytest.mark.parametrize("module", ["corpus", "instructions"])
def test_python_dash_m_runs_the_module_once(module, tmp_path):
    target = tmp_path / ("texts" if module == "corpus" else "instructions.jsonl")
    warm.call(_run_as_main, module, str(target), timeout=120)  # DistributedRunError with the traceback on a warning
    assert target.exists()
