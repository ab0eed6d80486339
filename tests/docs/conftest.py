"""The docs tests' shared record of output folders (tests/docs/runner.py: share_folders)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def docs_output_folders(tmp_path_factory) -> Path:
    """A folder the groups of pages of this pytest run record their output folders in: under pytest-xdist the
    parent of the workers' base temporary folders (one per run), else this run's base temporary folder."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "docs-output-folders"
