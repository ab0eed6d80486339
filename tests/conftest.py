"""Shared pytest setup: hermetic caches, no network, quiet threads; fixtures for the example scripts."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

# Nothing in the suite may reach the Hub; subprocesses inherit these.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")


@pytest.fixture(scope="session", autouse=True)
def hermetic_cache(tmp_path_factory):
    """Tokenizers and processed datasets built by the suite go to a per-session folder (not the user's cache)."""
    folder = tmp_path_factory.mktemp("hf_llmkit_cache")
    previous = os.environ.get("HF_LLMKIT_CACHE")
    os.environ["HF_LLMKIT_CACHE"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("HF_LLMKIT_CACHE", None)
    else:
        os.environ["HF_LLMKIT_CACHE"] = previous


def load_example(name: str):
    """Import `examples/<name>.py` as a module (the examples folder is not a package)."""
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def run_clm():
    return load_example("run_clm")
