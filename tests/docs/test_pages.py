"""README.md and every page of docs/ run as written (issue 18 section 2).

Each page's shell commands run in order in one scratch folder of their own (`runner.PageRun`: steps capped by
appended flags, multi-rank and multi-machine commands included, a command for several machines filled in with this
machine's address); each Python block runs in a fresh folder and asserts what its text says.
"""

from __future__ import annotations

import pytest

from tests.docs.pages import blocks, commands, page_id, pages
from tests.docs.runner import PageRun, prepare_folder

PAGES_WITH_COMMANDS = [page for page in pages() if commands(page)]
PYTHON_BLOCKS = [(page, i) for page in pages() for i in range(len(blocks(page, "python")))]


@pytest.mark.parametrize("page", PAGES_WITH_COMMANDS, ids=page_id)
def test_page_commands_run_in_order(page, run_clm, tmp_path, capsys, monkeypatch):
    prepare_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    outcome = PageRun(tmp_path, run_clm, capsys).run(commands(page))
    stopped = {line: what for line, what in outcome.items() if what.startswith("stopped") and "cuda" not in what}
    assert not stopped, stopped  # every command works as typed (each trains in its own folder)
    assert len(outcome) == len({c.line for c in commands(page)}), outcome


@pytest.mark.parametrize(("page", "index"), PYTHON_BLOCKS, ids=[f"{page_id(p)}-{i + 1}" for p, i in PYTHON_BLOCKS])
def test_python_block_runs_as_written(page, index, tmp_path, monkeypatch):
    prepare_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = blocks(page, "python")[index]
    exec(compile(code, f"{page_id(page)} python block {index + 1}", "exec"), {"__name__": "__docs__"})


def test_every_command_kind_is_recognised():
    kinds = {c.line: c.kind for page in pages() for c in commands(page)}
    assert kinds["make quickstart"] == "run_clm" and kinds["bash examples/run_pt.sh"] == "run_pt"
    assert {"run_clm", "launcher", "machines", "run_pt", "shell", "make", "bench"} <= set(kinds.values()), kinds
