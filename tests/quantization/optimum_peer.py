"""optimum's `ORTModelForCausalLM` (PyPI `optimum-onnx`) in an environment of its own, for the export tests.

optimum-onnx 0.1.0 pins transformers < 4.58, so it cannot install beside ours: `optimum_python()` builds a virtual
environment once into the hf_llmkit cache (`peers/optimum-onnx-...`) with transformers 4.57, optimum 2.1,
optimum-onnx and our onnxruntime from the registry, and lets it import this interpreter's torch (a `.pth` line
after its own packages: torch is not reinstalled). A lock serialises builders; a `ready` file marks a finished one.
Returns None and the reason where it cannot be built (no registry reachable).
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

PINS = ["transformers==4.57.6", "optimum==2.1.0", "optimum-onnx==0.1.0"]


def optimum_python() -> tuple[Path | None, str]:
    import torch

    from hf_llmkit.data.corpus import default_cache_dir

    runtime = importlib.metadata.version("onnxruntime")
    tag = f"optimum-onnx-0.1.0-ort{runtime}-py{sys.version_info.major}{sys.version_info.minor}"
    folder = default_cache_dir() / "peers" / tag
    python = folder / "bin" / "python"
    if (folder / "ready").is_file():
        return python, ""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{tag}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "ready").is_file():
            return python, ""
        shutil.rmtree(folder, ignore_errors=True)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        steps = [
            [sys.executable, "-m", "venv", str(folder)],
            [*pip, PINS[0], "onnx", f"onnxruntime=={runtime}", "numpy", "packaging"],
            [*pip, "--no-deps", *PINS[1:]],  # their torch requirement is met by ours (below)
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                shutil.rmtree(folder, ignore_errors=True)
                last = (done.stderr.strip().splitlines() or ["no message"])[-1]
                return None, f"could not build optimum-onnx's environment ({last[:200]})"
        site = next((folder / "lib").glob("python*/site-packages"))
        (site / "zz_torch_of_the_test_interpreter.pth").write_text(str(Path(torch.__file__).parent.parent) + "\n")
        (folder / "ready").write_text("")
    return python, ""
