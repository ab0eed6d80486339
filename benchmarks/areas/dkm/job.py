"""The `job` section of dkm_quality.py: where the time of the main job goes at LLM shapes, outside the steps.

`python examples/run_clm.py --quantization dkm` on a Llama shape built from scratch (bf16 weights, bf16 autocast,
batch 1 x 128 tokens, 2 steps, `--save_strategy no`, the job's evaluations before and after and its final save),
against the same job without quantization (full fine-tuning) and with the C allocator's default thresholds
(`hf_llmkit/cli/allocator.py` says why the job changes them). Each run is a fresh process (`python areas/dkm/job.py OUT
FLAGS...`) whose phases are timed by wrapping the functions that own them: the model build (of which the k-means
table initialisation), `Trainer.train`, `Trainer.evaluate` and the final `save_model`; what is left is the
interpreter's start, the imports and the (cached) tokenized data. The peak resident memory is `getrusage`'s.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

SHAPES = {  # name: (hidden, MLP, layers, query heads, key/value heads)
    "280M": (1024, 2304, 24, 16, 16),  # the shape: 279M parameters
    "1B": (2048, 5632, 22, 32, 4),  # TinyLlama-1.1B's layers; 986M parameters with the 4,096-token vocabulary
    "tiny": (128, 352, 2, 4, 2),  # --quick
}
DKM = ["--quantization", "dkm", "--dkm_bits", "3"]
# glibc's own thresholds: a malloc tunable of the user's (here tcache_count at its default) leaves them alone
DEFAULT_ALLOCATOR = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}
METHODS = {  # name: (flags, environment)
    "full fine-tuning, bf16": ([], {}),
    "DKM 3-bit, bf16": (DKM, {}),
    "DKM 3-bit, bf16, glibc's default allocator thresholds": (DKM, DEFAULT_ALLOCATOR),
}
PHASES = ("build", "kmeans", "train", "evaluate", "save")


def flags(shape: str, method: str, out_dir: Path) -> list[str]:
    hidden, mlp, layers, heads, kv = SHAPES[shape]
    return [
        "--hidden_size", str(hidden), "--intermediate_size", str(mlp), "--num_hidden_layers", str(layers),
        "--num_attention_heads", str(heads), "--num_key_value_heads", str(kv), "--torch_dtype", "bfloat16",
        "--bf16", "true", "--use_cpu", "true", "--per_device_train_batch_size", "1", "--block_size", "128",
        "--max_steps", "2", "--save_strategy", "no", "--output_dir", str(out_dir), "--overwrite_output_dir",
        "--disable_tqdm", "true", "--report_to", "none", *METHODS[method][0],
    ]  # fmt: skip


def run(shape: str, method: str, work: Path, fork: bool = False) -> dict:
    """One job in a fresh process: wall seconds, seconds per phase, peak RSS and parameters. `fork` (dkm_quality.py
    --quick, a smoke test): a child forked from this process instead, so "the rest" holds no interpreter start and
    no imports; only for a method without environment settings (those act at an interpreter's start) and where this
    process's torch ran one thread (a fork of a process whose OpenMP pool ran several threads can hang in it)."""
    import torch

    out = work / "phases.json"
    argv = flags(shape, method, work / "run")
    start = time.perf_counter()
    if fork and not METHODS[method][1] and torch.get_num_threads() == 1:
        import multiprocessing

        child = multiprocessing.get_context("fork").Process(target=_child, args=(out, argv))
        child.start()
        child.join()
        wall = time.perf_counter() - start
        if child.exitcode != 0:
            return {"shape": shape, "method": method, "error": f"exit {child.exitcode} (its output is above)"}
    else:
        env = {**os.environ, **METHODS[method][1]}
        proc = subprocess.run([sys.executable, __file__, str(out), *argv], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"shape": shape, "method": method, "error": f"exit {proc.returncode}: {tail[0][:200]}"}
    row = {"shape": shape, "method": method, "wall_s": wall, **json.loads(out.read_text())}
    row["other_s"] = wall - sum(row[phase] for phase in PHASES if phase != "kmeans")  # start, imports, data
    return row


def _child(out: Path, argv: list[str]) -> None:
    """Runs the job with its phases timed; writes {phase: seconds, peak_rss_mb, parameters} to `out`."""
    sys.path.insert(0, str(EXAMPLES))
    import run_clm
    from transformers import Trainer

    from hf_llmkit.cli import job
    from hf_llmkit.quantization import _dkm
    from hf_llmkit.trainers.llmkit_trainer import LLMKitTrainer

    seconds = dict.fromkeys(PHASES, 0.0)
    built = {}

    def timed(owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                result = original(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - start
            if phase == "build":
                built["parameters"] = sum(p.numel() for p in result.model.parameters())
            return result

        setattr(owner, name, wrapper)

    timed(job, "build_model", "build")
    timed(_dkm, "kmeans", "kmeans")
    timed(Trainer, "train", "train")
    timed(Trainer, "evaluate", "evaluate")
    timed(LLMKitTrainer, "save_model", "save")
    sys.argv = ["run_clm.py", *argv]
    run_clm.main()  # as the command runs it (its allocator setting included)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    out.write_text(json.dumps({**seconds, "peak_rss_mb": peak, **built}))


if __name__ == "__main__":
    _child(Path(sys.argv[1]), sys.argv[2:])
