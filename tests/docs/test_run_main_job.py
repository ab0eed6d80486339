"""docs/main_job.md's commands run as typed, in reading order in one folder (tests/docs/runner.py: run_group).

Each group of pages (tests/docs/pages.py: RUN_GROUPS) is a test file of its own, so that the two pytest workers
share the pages; their output folders are compared across the groups (runner.share_folders).
"""

from __future__ import annotations

import pytest

from tests.docs.runner import run_group


@pytest.mark.slow
@pytest.mark.timeout(1800)  # multi-rank runs: a minute or two alone on 2 cores, many more on a loaded machine
def test_main_job_runs_in_reading_order_in_one_folder(
    run_clm, tmp_path, capsys, monkeypatch, docs_output_folders, shared_runs
):
    """`bash examples/run_pt.sh` is made once per pytest run for this test and tests/examples/test_seed_recipe.py
    (runner.shared_run)."""
    run_group("main_job", run_clm, tmp_path, capsys, monkeypatch, docs_output_folders, shared_runs)
