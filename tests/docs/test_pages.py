"""README.md, every page of docs/, CONTRIBUTING.md and benchmarks/README.md run as written (issues 18 and 33).

Every shell command of every page runs in reading order in a scratch folder it shares with the other pages of its
group (`runner.PageRun`: step counts and model sizes shortened, everything else as typed, output folders included),
so two documented commands that collide show up, also across groups (`runner.share_folders`); multi-rank and
multi-machine commands included, a command for several machines filled in with this machine's address. Each group
is a test file of its own, tests/docs/test_run_<group>.py (`pages.RUN_GROUPS`), so that the two pytest workers share
them. Commands for a CUDA device are tests marked gpu. Each Python block runs in a fresh folder and asserts what its
text says. Each command written inline in prose is covered as tests/docs/inline.py says.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.docs.inline import JOB, UNTESTED, all_inline, block_lines, coverage
from tests.docs.pages import OTHER_PAGES, RUN_GROUPS, blocks, commands, fenced, group_commands, page_id, pages
from tests.docs.runner import PageRun, prepare_folder, share_folders

ALL_COMMANDS = [command for page in pages() for command in commands(page)]
GPU_COMMANDS = [command for command in ALL_COMMANDS if command.gpu]
PYTHON_BLOCKS = [(page, i) for page in pages() for i in range(len(blocks(page, "python")))]


def test_every_page_runs_in_one_group_whose_test_file_runs_it():
    assert {page for ids in RUN_GROUPS.values() for page in ids} <= {page_id(p) for p in pages()}, RUN_GROUPS
    groups = [*RUN_GROUPS, OTHER_PAGES]
    grouped = [(c.page, c.line) for group in groups for c in group_commands(group)]
    assert sorted(grouped) == sorted((c.page, c.line) for c in ALL_COMMANDS)
    for group in groups:  # its test file runs the group (tests/docs/runner.py: run_group)
        test_file = Path(__file__).parent / f"test_run_{group}.py"
        assert test_file.is_file() and f'run_group("{group}"' in test_file.read_text(), test_file.name


@pytest.mark.gpu
@pytest.mark.parametrize("command", GPU_COMMANDS, ids=[f"{c.page}:{c.line}" for c in GPU_COMMANDS])
def test_gpu_command_runs_as_typed(command, run_clm, tmp_path, capsys, monkeypatch):
    prepare_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    outcome = PageRun(tmp_path, run_clm, capsys).run_gpu(command)
    assert not outcome.startswith("stopped"), outcome


@pytest.mark.parametrize(("page", "index"), PYTHON_BLOCKS, ids=[f"{page_id(p)}-{i + 1}" for p, i in PYTHON_BLOCKS])
def test_python_block_runs_as_written(page, index, tmp_path, monkeypatch):
    prepare_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = blocks(page, "python")[index]
    exec(compile(code, f"{page_id(page)} python block {index + 1}", "exec"), {"__name__": "__docs__"})


def test_every_command_kind_is_recognised():
    kinds = {c.line: c.kind for c in ALL_COMMANDS}
    assert kinds["make quickstart"] == "run_clm" and kinds["bash examples/run_pt.sh"] == "run_pt"
    assert {"run_clm", "script", "python", "launcher", "machines", "run_pt", "shell", "make", "bench"} <= set(
        kinds.values()
    ), kinds
    assert GPU_COMMANDS and all("--device cuda" in c.line or c.kind != "bench" for c in GPU_COMMANDS)


def test_shell_blocks_are_fenced_as_bash():
    """A block fenced as sh / shell / console would never run: the pages' commands are ```bash blocks."""
    shells = {"sh", "shell", "console", "zsh"}
    odd = [(page_id(p), lang) for p in pages() for lang, _, _ in fenced(p) if lang in shells]
    assert not odd, f"fence these blocks as bash so that the docs test runs them: {odd}"


@pytest.mark.parametrize(("page", "command"), all_inline(), ids=[f"{p}:{c[:60]}" for p, c in all_inline()])
def test_each_inline_command_is_a_block_or_untested_on_purpose(page, command):
    how = coverage(command, block_lines())
    assert how, f"{page}: `{command}` is written inline: make it a ```bash block, or list it in UNTESTED with why"
    if how == "make":  # checked as the blocks' make lines are
        argv = ["make", "-n", "-B", *shlex.split(command)[1:]]
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, (command, proc.stderr)
    elif how == "parsed":  # a main job's flags parse as typed
        from hf_llmkit.cli.job import parse_args
        from tests.conftest import load_example

        job, flags = JOB.fullmatch(command).groups()
        parse_args(load_example(job).JOB, shlex.split(flags or ""))


def test_every_untested_pattern_says_why_and_is_still_used():
    used = {coverage(command, block_lines()) for _, command in all_inline()}
    for pattern, why in UNTESTED.items():
        assert len(why) > 20 and f"untested: {why}" in used, f"{pattern!r}: unused, or no reason: remove or explain"


def test_output_folders_are_compared_across_groups(tmp_path):
    """Of two groups, the one that ends later finds a command of the other in its output folder (runner.share_folders):
    as in one folder, where the later would resume the other's run or be refused its typed folder."""
    clm = {"command": "python examples/run_clm.py", "typed": False, "flags": {"job": "run_clm.py", "seed": 42}}
    share_folders(tmp_path, "a", {"outputs/run_clm": clm, "outputs/mine": {**clm, "typed": True}})
    share_folders(tmp_path, "b", {"outputs/run_clm": clm})  # the same command: it resumes its own run
    other_seed = {"command": "python examples/run_clm.py --seed 7", "typed": False, "flags": {"seed": 7}}
    share_folders(tmp_path, "c", {"outputs/run_clm": other_seed})  # a default folder of other flags moves on
    with pytest.raises(AssertionError, match="the folder of 'python examples/run_clm.py'"):
        share_folders(tmp_path, "d", {"outputs/run_clm": {**clm, "command": "make quickstart"}})  # same flags
    with pytest.raises(AssertionError, match="trains in outputs/mine"):
        share_folders(tmp_path, "e", {"outputs/mine": {**other_seed, "typed": True}})  # a typed folder
