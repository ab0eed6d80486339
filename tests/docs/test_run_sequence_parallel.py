"""docs/sequence_parallel.md's commands run as typed, in reading order in one folder (tests/docs/runner.py:
run_group): 4 ranks train on the typed 16,384-token blocks.

Each group of pages (tests/docs/pages.py: RUN_GROUPS) is a test file of its own, so that the two pytest workers
share the pages; their output folders are compared across the groups (runner.share_folders).
"""

from __future__ import annotations

import pytest

from tests.docs.runner import run_group


@pytest.mark.slow
@pytest.mark.timeout(1800)  # multi-rank runs: a minute or two alone on 2 cores, many more on a loaded machine
def test_sequence_parallel_runs_in_reading_order_in_one_folder(
    run_clm, tmp_path, capsys, monkeypatch, docs_output_folders
):
    run_group("sequence_parallel", run_clm, tmp_path, capsys, monkeypatch, docs_output_folders)
