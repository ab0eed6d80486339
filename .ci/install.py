"""`pip install` for the Makefile, through uv when it can be had: the same requirements, indexes and resolution rule.

    python .ci/install.py VENV_PYTHON -e ".[dev]"          # what `make install` runs
    HF_LLMKIT_INSTALLER=pip python .ci/install.py ...       # pip itself, never uv

uv installs the suite's environment (a CUDA torch build and its libraries, 2.9 GB) in about a tenth of pip's time: it
downloads and unpacks in parallel. It reads none of pip's configuration, so the indexes, find-links folders and
certificate pip is configured with (its config files and PIP_* variables: `pip config list`) are passed on, and it
picks the best version across all of them as pip does (`--index-strategy unsafe-best-match`). Where uv cannot be
installed (no index serves it), pip installs instead; a uv install that fails is a failed install, never retried
with pip (a second resolution could silently differ).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

# pip configuration keys (any scope: global., install., :env:.) -> uv flags; space-separated values repeat the flag
LIST_FLAGS = {"extra-index-url": "--extra-index-url", "find-links": "--find-links"}
ONE_FLAGS = {"index-url": "--index-url"}


def pip_settings(python: str) -> dict[str, str]:
    """pip's effective settings for an install (`pip config list`): later scopes override earlier ones."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
    ranked: dict[str, tuple[int, str]] = {}
    order = {"global": 0, "user": 1, "site": 2, "install": 3, ":env:": 4}
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        value = value.strip().strip("'\"")
        rank = order.get(scope, 0)
        if name and (name not in ranked or rank >= ranked[name][0]):
            ranked[name] = (rank, value)
    return {name: value for name, (_, value) in ranked.items()}


def uv_flags(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    flags = ["--index-strategy", "unsafe-best-match"]
    for name, flag in ONE_FLAGS.items():
        if settings.get(name):
            flags += [flag, settings[name]]
    for name, flag in LIST_FLAGS.items():
        for value in settings.get(name, "").split():
            flags += [flag, value]
    if settings.get("no-index", "").lower() in {"1", "true", "yes", "on"}:
        flags.append("--no-index")
    env = {}
    if settings.get("cert"):
        env["SSL_CERT_FILE"] = settings["cert"]
    return flags, env


def have_uv(python: str) -> bool:
    probe = [python, "-m", "uv", "--version"]
    if subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return True
    fetched = subprocess.run([python, "-m", "pip", "install", "--quiet", "uv"], check=False)
    return fetched.returncode == 0 and subprocess.run(probe, capture_output=True, check=False).returncode == 0


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        raise SystemExit("usage: python .ci/install.py VENV_PYTHON REQUIREMENT_OR_PIP_FLAG...")
    python, args = argv[0], argv[1:]
    if os.environ.get("HF_LLMKIT_INSTALLER", "uv") != "pip" and have_uv(python):
        flags, env = uv_flags(pip_settings(python))
        command = [python, "-m", "uv", "pip", "install", "--python", python, *flags, *args]
        environment = {**os.environ, **env}
    else:
        command, environment = [python, "-m", "pip", "install", *args], dict(os.environ)
    print("+", shlex.join(command), flush=True)
    return subprocess.run(command, env=environment, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
