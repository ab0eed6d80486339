"""The docs tests' shared record of output folders (tests/docs/runner.py: share_folders)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_folder


@pytest.fixture(scope="session")
def docs_output_folders(tmp_path_factory) -> Path:
    """A folder the groups of pages of this pytest run record their output folders in, shared by the xdist workers."""
    return run_folder(tmp_path_factory, "docs-output-folders")
