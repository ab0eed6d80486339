"""The documentation as data: its pages, their fenced blocks, and every shell command classified by how it runs.

A page is README.md or a file of docs/. Commands are read from ```bash blocks (comments dropped, `\\` continuation
lines joined); Python from ```python blocks. Each command gets a kind that says how the test runs it:

- `run_clm`: `python examples/run_clm.py ...` (and `make quickstart`, the Makefile's `$(PY) examples/run_clm.py`), run
  in this process (an import of torch and transformers per command would cost more than the training);
- `script`: `python examples/<other>.py ...` (the other main job, `run_sft.py`), in this process too;
- `python`: `python -c CODE` and `python -m MODULE ...`, in this process as the interpreter runs them (same reason);
- `bench`: `python benchmarks/<name>.py ...` with `--quick` appended, as the interpreter runs it, in a fresh child of
  the warm interpreter (tests/warm.py; a new interpreter for a CUDA device's);
- `launcher`: `accelerate launch`, `torchrun`, `deepspeed` on this machine (the launcher in a fresh child of the warm
  interpreter, tests/warm.py; its ranks start as new interpreters, as typed);
- `machines`: a command for one machine of several (it names `MACHINE0`, the first machine's address): the commands
  of one block are the machines of one job, started together with `MACHINE0` = 127.0.0.1 (a block with one such
  command is run on two "machines", as the page says the same command runs on every machine);
- `run_pt`: `bash examples/run_pt.sh`;
- `make`: other `make` lines, checked with `make -n -B` (`make test` is the command running this suite);
- `shell`: anything else, run by bash in the page's folder.

A command for a CUDA device (`--device cuda`, or any command of a block fenced as ```` ```bash gpu ````) is `gpu`:
it runs in a test marked `gpu`, not in the CPU run of the pages. Commands written inline in prose (a code span that
starts with a command) are listed by `inline_commands`; tests/docs/inline.py says how each is covered.

The pages run in groups (`RUN_GROUPS`), one test file each (tests/docs/test_run_<group>.py), so that the two pytest
workers share them: a group's pages in reading order, in one folder of its own.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import REPO

DOCS = REPO / "docs"
MACHINE_PLACEHOLDER = "MACHINE0"


GPU_LINE = re.compile(r"--device[ =]cuda\b")
# The start of a command in a code span of prose: a tool, then at least one argument.
INLINE = re.compile(
    r"`((?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:(?:python3?|bash|sh|make|torchrun|deepspeed|pip|pytest|\.venv/bin/\w+)\s[^`]+"
    r"|accelerate (?:launch|config|env)\b[^`]*))`"
)
# Blocks, generated result regions (their provenance lines name the commands that measured them), comments.
HIDDEN_IN_PROSE = re.compile(r"^```.*?^```|^<!-- results:.*?^<!-- end results -->|<!--.*?-->", re.S | re.M)


def pages() -> list[Path]:
    """README.md, every page under docs/, CONTRIBUTING.md and benchmarks/README.md: the order a reader follows."""
    return [REPO / "README.md", *sorted(DOCS.glob("*.md")), REPO / "CONTRIBUTING.md", REPO / "benchmarks/README.md"]


def page_id(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


# The pages whose commands run apart from the others (each its own test file: minutes of multi-rank runs), by the
# group's name; every other page is in the group "other_pages". A page's commands stay together, in reading order.
RUN_GROUPS = {
    "main_job": ["docs/main_job.md"],
    "multi_node": ["docs/multi_node.md"],
    "sequence_parallel": ["docs/sequence_parallel.md"],
}
OTHER_PAGES = "other_pages"


def run_group(page: Path) -> str:
    return next((group for group, ids in RUN_GROUPS.items() if page_id(page) in ids), OTHER_PAGES)


def fenced(page: Path) -> list[tuple[str, str, str]]:
    """(language, the rest of the fence's info string, body) of every fenced block of `page`, in order."""
    found = re.findall(r"^```([\w+-]*)[ \t]*([^\n]*)\n(.*?)^```", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return [(language, info.strip(), body) for language, info, body in found]


def blocks(page: Path, language: str) -> list[str]:
    """The fenced code blocks of `page` in one language, in order."""
    return [body for lang, _, body in fenced(page) if lang == language]


def inline_commands(page: Path) -> list[str]:
    """Commands written in code spans of the prose (blocks, comments and generated result regions left out) and
    in blocks fenced without a language, whitespace normalised (a span may wrap over two lines)."""
    text = HIDDEN_IN_PROSE.sub("", page.read_text(encoding="utf-8"))
    found = [" ".join(span.split()) for span in INLINE.findall(text)]
    for language, _, body in fenced(page):  # a block fenced without a language is prose to the docs test
        if not language:
            lines = [line.split(" #")[0].strip() for line in body.replace("\\\n", " ").splitlines()]
            found += [" ".join(line.split()) for line in lines if INLINE.fullmatch(f"`{line}`")]
    return found


@dataclass
class Command:
    line: str
    kind: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # leading VAR=value assignments
    block: int = 0  # index of the bash block it came from
    gpu: bool = False  # needs a CUDA device: run by a test marked gpu
    page: str = ""


def commands(page: Path) -> list[Command]:
    """Every command of every bash block of `page`, in order."""
    found = []
    bash = [(info, body) for language, info, body in fenced(page) if language == "bash"]
    for index, (info, block) in enumerate(bash):
        for line in block.replace("\\\n", " ").splitlines():
            line = "" if line.lstrip().startswith("#") else line.split(" #")[0].strip()
            if line:
                command = classify(line, block=index)
                command.gpu = "gpu" in info.split() or bool(GPU_LINE.search(line))
                command.page = page_id(page)
                found.append(command)
    return found


def group_commands(group: str) -> list[Command]:
    """Every command of the group's pages, in reading order."""
    return [command for page in pages() if run_group(page) == group for command in commands(page)]


def classify(line: str, *, block: int = 0) -> Command:
    argv = shlex.split(line)
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    head = argv[:2]
    if MACHINE_PLACEHOLDER in line:
        kind = "machines"
    elif head == ["make", "quickstart"]:
        kind, argv = "run_clm", ["python", "examples/run_clm.py"]
    elif argv[0] == "make":
        kind = "make"
    elif head == ["python", "examples/run_clm.py"]:
        kind = "run_clm"
    elif argv[0] == "python" and len(argv) > 2 and argv[1] in ("-c", "-m"):
        kind = "python"
    elif argv[0] == "python" and len(argv) > 1 and argv[1].startswith("examples/"):
        kind = "script"
    elif argv[0] == "python" and len(argv) > 1 and argv[1].startswith("benchmarks/"):
        kind = "bench"
    elif argv[0] in ("accelerate", "torchrun", "deepspeed"):
        kind = "launcher"
    elif head == ["bash", "examples/run_pt.sh"]:
        kind = "run_pt"
    else:
        kind = "shell"
    return Command(line, kind, argv, env, block)
