"""Kill-and-resume of the main job: SIGKILL `examples/run_clm.py` after a checkpoint, re-run the same command, and
compare every final artifact with an uninterrupted run, byte for byte.

Run as `python tests/callbacks/clm_kill_harness.py WORKDIR --ranks 1 -- <run_clm flags>`; prints one JSON line. It
imports run_clm (torch, transformers, peft, datasets) once and forks every run from that warm process, like
`kill_harness.py`; with `--ranks 2` each run is two forked ranks joined by a gloo group (what `torchrun` sets up).
Each run calls `run_clm.main()` with the command line, so exit codes are the script's own.

1. reference: the command, uninterrupted, into `WORKDIR/reference`;
2. killed: the command into `WORKDIR/resumed`, SIGKILLed (every rank) once its first checkpoint is complete;
3. resumed: the same command again, to the end.

Then every file of the final model, adapter and tokenizer folders is compared (run records such as
`trainer_state.json`, results, manifests and `training_args.bin`, which names the output folder, are left out).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402  (after the path: the repository's tests package)
from safetensors.torch import load_file  # noqa: E402

from hf_llmkit.callbacks.checkpoint_manifest import MANIFEST_NAME, list_checkpoints  # noqa: E402
from hf_llmkit.testing import free_port  # noqa: E402
from tests.conftest import load_example  # noqa: E402

# Files that record a run rather than its result.
RUN_RECORDS = {"trainer_state.json", "training_args.bin", MANIFEST_NAME, "all_results.json", "eval_results.json"}
RUN_RECORDS |= {"train_results.json", "README.md"}


def _child(run_clm, argv: list[str], rank: int, world: int, port: int) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        if world > 1:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        sys.argv = ["run_clm.py", *argv]
        run_clm.main()
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except BaseException as err:  # noqa: BLE001 - reported through the exit status
        print(f"rank {rank} failed: {err!r}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Run:
    """One run of the command: `world` forked ranks."""

    def __init__(self, run_clm, argv: list[str], world: int):
        port = free_port()
        self.pids = []
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                _child(run_clm, argv, rank, world, port)
            self.pids.append(pid)
        self.codes: dict[int, int] = {}

    def poll(self) -> bool:
        for pid in self.pids:
            if pid not in self.codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.codes[pid] = os.waitstatus_to_exitcode(status)
        return len(self.codes) == len(self.pids)

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        while not self.poll():
            if time.monotonic() > deadline:
                self.kill()
                break
            time.sleep(0.02)
        return [self.codes[pid] for pid in self.pids]

    def kill(self) -> bool:
        """SIGKILL every rank still running; True when at least one was killed."""
        alive = [pid for pid in self.pids if pid not in self.codes]
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
        for pid in alive:
            self.codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        return bool(alive)


def _first_complete_checkpoint(output_dir: Path, run: Run, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not run.poll():
        done = [p.name for p in list_checkpoints(output_dir) if (p / MANIFEST_NAME).is_file()]
        if done:
            return done[0]
        time.sleep(0.002)
    return None


def artifacts(output_dir: Path) -> dict[str, Path]:
    """Final model / adapter / tokenizer files: the top of output_dir and its `adapter/` (and `merged/`)."""
    found = {}
    for folder in (output_dir, output_dir / "adapter", output_dir / "merged"):
        if folder.is_dir():
            for path in sorted(folder.iterdir()):
                if path.is_file() and path.name not in RUN_RECORDS and not path.name.startswith("."):
                    found[path.relative_to(output_dir).as_posix()] = path
    return found


def compare(reference: Path, resumed: Path) -> dict:
    ref, res = artifacts(reference), artifacts(resumed)
    report: dict = {"files": sorted(ref), "missing": sorted(set(ref) - set(res)), "extra": sorted(set(res) - set(ref))}
    differing = {}
    for name in sorted(set(ref) & set(res)):
        if ref[name].read_bytes() == res[name].read_bytes():
            continue
        detail = "bytes differ"
        if name.endswith(".safetensors"):
            a, b = load_file(ref[name]), load_file(res[name])
            keys = sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))
            detail = f"{len(keys)} tensors differ, e.g. {keys[:3]}"
        differing[name] = detail
    report["differing"] = differing
    return report


def run(workdir: Path, argv: list[str], ranks: int, timeout: float) -> dict:
    run_clm = load_example("run_clm")
    reference, resumed = workdir / "reference", workdir / "resumed"
    start = time.monotonic()
    ref_codes = Run(run_clm, [*argv, "--output_dir", str(reference)], ranks).wait(timeout)
    killed_run = Run(run_clm, [*argv, "--output_dir", str(resumed)], ranks)
    first = _first_complete_checkpoint(resumed, killed_run, timeout)
    killed = killed_run.kill()
    left = sorted(p.name for p in resumed.iterdir()) if resumed.is_dir() else []
    final_codes = Run(run_clm, [*argv, "--output_dir", str(resumed)], ranks).wait(timeout)
    return {
        "reference_exit": ref_codes,
        "killed_after": first,
        "killed": killed,
        "left_after_kill": left,
        "resumed_exit": final_codes,
        "comparison": compare(reference, resumed),
        "seconds": time.monotonic() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=240.0)
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    ns = parser.parse_args(sys.argv[1:split])
    print(json.dumps(run(ns.workdir, sys.argv[split + 1 :], ns.ranks, ns.timeout)), flush=True)


if __name__ == "__main__":
    main()
