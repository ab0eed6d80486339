"""How each command written inline in the docs' prose is covered (issue 33): a reader may type any of them.

- the same command is in a bash block of a page: the pages' test runs it;
- a `make` command: checked with `make -n -B`, as the blocks' make lines are;
- a main job's command (`python examples/run_*.py ...`): its flags are parsed by the job (no training: it is an
  excerpt of a documented run, whose own block trains);
- anything else is listed in `UNTESTED` (a pattern and why it is not run), or the test fails.
"""

from __future__ import annotations

import re

from tests.docs.pages import commands, inline_commands, pages

UNTESTED: dict[str, str] = {  # pattern (whole command) -> why the docs test does not run it
    r"python benchmarks/(?!report\.py)\w+\.py\b.*": "a benchmark's measuring run (minutes to hours); every script's "
    "--quick mode runs in tests/benchmarks/test_quick_modes.py, the GPU commands in tests/docs (marked gpu)",
    r"bash benchmarks/install_peers\.sh": "installs peers from the registry into the environment the suite runs in",
    r"python -m tests\.\w+\.\w+ --write": "rewrites its page's generated table; the page's test compares it",
    r"python3? -m venv|pip install -e.*": "installing into a fresh environment: `make install` (a block command) does "
    "it, and CI (.ci/run) runs it on a clean clone",
    r"\.venv/bin/python -m ruff .*": "the lint `make test` runs first (ruff check), and `make lint` / `make format`",
    r"bash \.ci/run": "CI itself: it runs the whole suite, this test included",
    r"(?:\.venv/bin/)?python -m pytest .*": "runs part of the suite, which `make test` (a block command) runs whole",
    r"accelerate launch": "the launcher's name in prose; its documented commands are blocks",
    r"python -m hf_llmkit\.quantization\.export (?:onnx|coreml) CHECKPOINT .*": "placeholders for the user's paths; "
    "tests/quantization/test_export_onnx.py runs the command on a saved checkpoint",
    r"python -m hf_llmkit\.cli\.merge OUTPUT_DIR": "a placeholder for the user's path; "
    "tests/examples/test_run_clm_peft.py runs the command on a finished run",
    r"pip install --no-(?:index|deps) .*": "what the GPU check's install part runs on the GPU machine "
    "(benchmarks/gpu_check.py); its plumbing mode runs in tests/benchmarks/test_gpu_check.py",
    r"pip install llama-cpp-python==[\d.]+": "builds llama.cpp from source (minutes); the benchmark part that needs "
    "it records a row with its reason where it is missing, tests/benchmarks/test_quick_modes.py runs that part",
    r"pytest -m gpu tests/gpu": "the CUDA tests (`make test-gpu`); without a GPU they skip with their reason in "
    "`make test`",
}
JOB = re.compile(r"python examples/(run_\w+)\.py(?: (.*))?")


def block_lines() -> set[str]:
    return {" ".join(c.line.split()) for page in pages() for c in commands(page)}


def coverage(command: str, blocks: set[str]) -> str:
    """How `command` is covered: "block", "make", "parsed", "untested: <reason>", or "" (not at all)."""
    if command in blocks:
        return "block"
    if command.startswith("make "):
        return "make"
    if JOB.fullmatch(command):
        return "parsed"
    for pattern, reason in UNTESTED.items():
        if re.fullmatch(pattern, command):
            return f"untested: {reason}"
    return ""


def all_inline() -> list[tuple[str, str]]:
    """(page, command) of every inline command of every page."""
    from tests.docs.pages import page_id

    return [(page_id(page), command) for page in pages() for command in inline_commands(page)]
