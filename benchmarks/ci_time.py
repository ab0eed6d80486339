#!/usr/bin/env python
"""How long CI takes, as a stranger sees it: clones this repository's HEAD commit into a temporary folder and runs
`bash .ci/run` there (a new virtual environment, pip's and uv's caches empty, no Hugging Face / torch-extension /
hf_llmkit caches), recording the total wall time, the install time, the ruff time and pytest's summary (counts,
duration).

    python benchmarks/ci_time.py            # about 25 minutes of both cores: run it alone, on an idle machine

Uncommitted changes are not part of the run (it is HEAD, as a fresh clone gets it). Writes
benchmarks/results/ci.json, which the docs' CI-time line is generated from (`python benchmarks/report.py
--write`). `make bench` does not run it. `--device` / `--quick` do not apply: the run is the CPU suite, whole.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.common import write_results

REPO = Path(__file__).resolve().parents[1]
INSTALL_DONE = re.compile(r"^touch \S*\.hf_llmkit-installed\s*$")  # make's echo of the install's last command
PYTEST_START = re.compile(r"^\S*python\S* -m pytest\b")
CI_FINISHED = re.compile(r"^CI finished in (\d+) s\s*$")  # .ci/run's last line
STAGE_FINISHED = re.compile(r"^(make [\w-]+) finished in (\d+) s\s*$")  # .ci/run's line after each make target
AFTER_RUFF = re.compile(r"^\S*python\S* -c .*versions under test")  # make's echo of the command after ruff
VERSIONS = re.compile(r"^versions under test: (.+)$")  # the Makefile's line before each pytest run
SUMMARY = re.compile(  # "=== 709 passed, 1 skipped in 421.87s (0:07:01) ===", or without the "=" under -q
    r"^(?:=+ )?(?P<counts>\d+ [a-z]+(?:, \d+ [a-z]+)*) in (?P<seconds>[\d.]+)s(?: \((?P<clock>[\d:]+)\))?(?: =+)?\s*$"
)
COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)\b")


def parse_log(lines: list[tuple[float, str]], returncode: int) -> dict:
    """Phases and pytest's summary from `.ci/run`'s output, each line with the seconds since the start. With more
    than one pytest run (a min-version subset after the suite), `pytest` is the largest and `pytest_runs` all."""
    install_end = next((t for t, line in lines if INSTALL_DONE.match(line)), None)
    pytest_start = next((t for t, line in lines if PYTEST_START.match(line) or AFTER_RUFF.match(line)), None)
    finished = [int(m[1]) for _, line in lines if (m := CI_FINISHED.match(line))]
    runs = [_summary(m) for _, line in lines if (m := SUMMARY.match(line))]
    stages = {m[1]: int(m[2]) for _, line in lines if (m := STAGE_FINISHED.match(line))}
    versions = [dict(zip(*[iter(m[1].split())] * 2)) for _, line in lines if (m := VERSIONS.match(line))]
    ruff = pytest_start - install_end if pytest_start is not None and install_end is not None else None
    return {
        "returncode": returncode,
        "passed": returncode == 0,
        "total_s": finished[-1] if finished else round(lines[-1][0]) if lines else None,
        "install_s": round(install_end) if install_end is not None else None,
        "ruff_s": round(ruff) if ruff is not None else None,
        "pytest": max(runs, key=_tests_run, default=None),
        "pytest_runs": runs,
        "stages_s": stages,  # make test, make test-lowest
        "versions": versions,  # per pytest run, in order: python, torch, transformers
    }


def _tests_run(run: dict) -> int:
    return sum(n for kind, n in run["counts"].items() if kind not in ("deselected", "warnings"))


def _summary(match: re.Match) -> dict:
    counts: dict[str, int] = {}
    for number, kind in COUNT.findall(match["counts"]):
        kind = {"error": "errors", "warning": "warnings"}.get(kind, kind)
        counts[kind] = counts.get(kind, 0) + int(number)
    return {"counts": counts, "seconds": float(match["seconds"]), "line": match[0].strip("= \n")}


def run_ci(repo: Path, commit: str) -> tuple[list[tuple[float, str]], int]:
    """Clone `commit` of `repo` into a temporary folder and run `bash .ci/run` there with empty caches; the output
    lines (echoed as they come) with their times."""
    with tempfile.TemporaryDirectory(prefix="ci_time_") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(repo), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", commit], check=True)
        caches = {
            "PIP_NO_CACHE_DIR": "1",
            "HF_HOME": f"{tmp}/hf",
            "XDG_CACHE_HOME": f"{tmp}/cache",
            "UV_CACHE_DIR": f"{tmp}/cache/uv",  # the Makefile installs through uv (.ci/install.py)
            "TORCH_HOME": f"{tmp}/torch",
        }
        venv = os.environ.get("VIRTUAL_ENV")
        path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not venv or not p.startswith(venv))
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "HF_LLMKIT_CACHE")}
        env.update(caches, PATH=path, PYTHONUNBUFFERED="1")
        start = time.perf_counter()
        lines = []
        proc = subprocess.Popen(
            ["bash", ".ci/run"], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in proc.stdout:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))
            print(line, end="", flush=True)
        return lines, proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the repository whose HEAD is cloned (default: this)")
    args = parser.parse_args(argv)
    commit = subprocess.run(
        ["git", "-C", str(args.repo), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    lines, returncode = run_ci(args.repo, commit)
    result = {"commit": commit, **parse_log(lines, returncode), "log_tail": [line for _, line in lines[-40:]]}
    print(f"\nwrote {write_results('ci', result)}")
    return returncode


if __name__ == "__main__":
    sys.exit(main())
