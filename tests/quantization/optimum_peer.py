"""optimum's `ORTModelForCausalLM` (PyPI `optimum-onnx`) beside our environment, for the export tests.

optimum-onnx 0.1.0 pins transformers < 4.58, so it cannot install beside ours: `optimum_python()` installs, once into
the hf_llmkit cache (`peers/optimum-onnx-...`), only the packages whose versions differ from ours (transformers 4.57
with the huggingface_hub and tokenizers it takes, optimum 2.1 and optimum-onnx) into a folder of their own
(`pip install --target --no-deps`: no virtual environment, no dependency resolution, no byte-compiling), and runs
this interpreter with that folder first on its path, so everything else (torch, onnxruntime, numpy...) is ours. A
lock serialises builders; the folder is renamed into place when complete. Returns the command prefix (interpreter
and environment) and an empty reason, or None and the reason where it cannot be built (no registry reachable).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys

PINS = ["transformers==4.57.6", "huggingface_hub>=0.34,<1.0", "tokenizers>=0.22,<=0.23.0", "optimum==2.1.0",
        "optimum-onnx==0.1.0"]  # fmt: skip


def optimum_python() -> tuple[tuple[list[str], dict[str, str]] | None, str]:
    from hf_llmkit.data.corpus import default_cache_dir

    tag = f"optimum-onnx-0.1.0-transformers-4.57.6-py{sys.version_info.major}{sys.version_info.minor}"
    folder = default_cache_dir() / "peers" / tag
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = ([sys.executable, "-s"], env)  # -s: no user site-packages between the folder and ours
    if folder.is_dir():
        return command, ""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{tag}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if folder.is_dir():
            return command, ""
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        pip = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-compile",
        ]
        done = subprocess.run([*pip, "--target", str(partial), *PINS], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            return None, f"could not install optimum-onnx beside ours ({last[:200]})"
        partial.rename(folder)
    return command, ""
