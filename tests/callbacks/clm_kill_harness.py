"""Interrupt-and-resume of the main job: stop `examples/run_clm.py` after a checkpoint (SIGKILL, or SIGTERM as a
scheduler does), re-run the same command, and compare every final artifact with an uninterrupted run, byte for byte.

    python tests/callbacks/clm_kill_harness.py WORKDIR [--ranks 2] [--signal SIGTERM] -- <run_clm flags>
    python tests/callbacks/clm_kill_harness.py WORKDIR --cases cases.json   # {"name": {"flags": [...], ...}}
    python tests/callbacks/clm_kill_harness.py WORKDIR --example run_sft --cases cases.json   # another main job

Prints one JSON line (one result, or name -> result); `run_cases` does the same as a function, for a process that is
already warm (tests/warm.py). It imports run_clm (torch, transformers, peft, datasets) once and forks every run from
that warm process, like `kill_harness.py`; with `--ranks 2` each run is two forked ranks joined by a gloo group (what
`torchrun` sets up). Each run calls `run_clm.main()` with the command line, so exit codes are the script's own; each
rank's output goes to `WORKDIR/logs/`.

1. reference: the command, uninterrupted, into `WORKDIR/reference` (cases of one command share the first one's);
2. interrupted: the command into `WORKDIR/resumed`, signalled (every rank) once its first checkpoint is complete;
   SIGKILL ends it at once, SIGTERM lets it save and exit on its own;
3. resumed: the same command again, to the end.

Then every file of the final model, adapter and tokenizer folders is compared (run records such as
`trainer_state.json`, results, manifests and `training_args.bin`, which names the output folder, are left out).
"""

from __future__ import annotations

import argparse
import gc
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

from hf_llmkit.checkpoints.names import MANIFEST_NAME, list_checkpoints  # noqa: E402
from hf_llmkit.testing import free_port  # noqa: E402
from tests.conftest import load_example  # noqa: E402

# Files that record a run rather than its result.
RUN_RECORDS = {"trainer_state.json", "training_args.bin", MANIFEST_NAME, "all_results.json", "eval_results.json"}
RUN_RECORDS |= {"train_results.json", "README.md"}


def _child(run_clm, argv: list[str], rank: int, world: int, port: int, log: Path) -> None:
    code = 0
    try:
        with open(log, "w") as handle:  # this rank's stdout and stderr
            os.dup2(handle.fileno(), 1)
            os.dup2(handle.fileno(), 2)
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
        sys.argv = [f"{run_clm.__name__.removeprefix('example_')}.py", *argv]
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
    """One run of the command: `world` forked ranks, each logging to `<log>-rank<r>.log`."""

    def __init__(self, run_clm, argv: list[str], world: int, log: Path):
        log.parent.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.logs = [log.with_name(f"{log.name}-rank{rank}.log") for rank in range(world)]
        self.pids = []
        gc.freeze()  # what exists now is never collected in a run: no run copies or walks the warm heap
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                _child(run_clm, argv, rank, world, port, self.logs[rank])
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
                self.signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        return [self.codes[pid] for pid in self.pids]

    def signal(self, signum: int) -> bool:
        """Send `signum` to every rank still running (SIGKILL: and reap them); True when one was running."""
        alive = [pid for pid in self.pids if pid not in self.codes]
        for pid in alive:
            os.kill(pid, signum)
        if signum == signal.SIGKILL:
            for pid in alive:
                self.codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        return bool(alive)

    def lines(self, needle: str) -> list[str]:
        return [line for log in self.logs for line in log.read_text(errors="replace").splitlines() if needle in line]


def _first_complete_checkpoint(output_dir: Path, run: Run, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not run.poll():
        done = [p.name for p in list_checkpoints(output_dir) if (p / MANIFEST_NAME).is_file()]
        if done:
            return done[0]
        time.sleep(0.002)
    return None


def artifacts(output_dir: Path) -> dict[str, Path]:
    """Final model / adapter / tokenizer files: the top of output_dir, its `adapter/`, the adapter's saved `base/`
    (and `merged/`)."""
    found = {}
    for folder in (output_dir, output_dir / "adapter", output_dir / "base", output_dir / "merged"):
        if folder.is_dir():
            for path in sorted(folder.iterdir()):
                if path.is_file() and path.name not in RUN_RECORDS and not path.name.startswith("."):
                    found[path.relative_to(output_dir).as_posix()] = path
    return found


def _run_relative(path: Path, output_dir: Path) -> bytes:
    """A file's bytes; in JSON files the run's own output folder reads as a placeholder (a from-scratch PEFT run's
    adapter_config.json names the base saved in its output folder, which differs between the two runs)."""
    data = path.read_bytes()
    return data.replace(str(output_dir).encode(), b"<output_dir>") if path.suffix == ".json" else data


def compare(reference: Path, resumed: Path) -> dict:
    ref, res = artifacts(reference), artifacts(resumed)
    report: dict = {"files": sorted(ref), "missing": sorted(set(ref) - set(res)), "extra": sorted(set(res) - set(ref))}
    differing = {}
    for name in sorted(set(ref) & set(res)):
        if _run_relative(ref[name], reference) == _run_relative(res[name], resumed):
            continue
        detail = "bytes differ"
        if name.endswith(".safetensors"):
            a, b = load_file(ref[name]), load_file(res[name])
            keys = sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))
            detail = f"{len(keys)} tensors differ, e.g. {keys[:3]}"
        differing[name] = detail
    report["differing"] = differing
    return report


def run_case(
    run_clm, workdir: Path, argv: list[str], *, ranks: int, signum: int, timeout: float, reference: tuple | None = None
) -> dict:
    """One case; `reference`: (folder, exit codes) of an uninterrupted run of the same command, when one was run."""
    resumed, logs = workdir / "resumed", workdir / "logs"
    start = time.monotonic()
    if reference is None:
        reference = workdir / "reference"
        ref_codes = Run(run_clm, [*argv, "--output_dir", str(reference)], ranks, logs / "reference").wait(timeout)
    else:
        reference, ref_codes = reference
    interrupted = Run(run_clm, [*argv, "--output_dir", str(resumed)], ranks, logs / "interrupted")
    first = _first_complete_checkpoint(resumed, interrupted, timeout)
    signalled = interrupted.signal(signum)
    interrupted_codes = interrupted.wait(timeout)
    left = sorted(p.name for p in resumed.iterdir()) if resumed.is_dir() else []
    final = Run(run_clm, [*argv, "--output_dir", str(resumed)], ranks, logs / "resumed")
    final_codes = final.wait(timeout)
    return {
        "reference_exit": ref_codes,
        "reference": str(reference),
        "interrupted_after": first,
        "signalled": signalled,
        "interrupted_exit": interrupted_codes,
        "interrupted_stop_lines": interrupted.lines("stopped at step"),
        "interrupted_tracebacks": len(interrupted.lines("Traceback")),
        "left_after_interruption": left,
        "resumed_exit": final_codes,
        "resumed_from": [line.strip() for line in final.lines("| resumed from")],
        "comparison": compare(reference, resumed),
        "seconds": time.monotonic() - start,
    }


def main() -> None:
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--signal", default="SIGKILL", choices=["SIGKILL", "SIGTERM"])
    parser.add_argument("--cases", type=Path, help="JSON: name -> {flags, ranks, signal}; run them all")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--example", default="run_clm", choices=["run_clm", "run_sft"], help="the main job to run")
    ns = parser.parse_args(sys.argv[1:split])
    if ns.cases is None:
        run_clm, argv = load_example(ns.example), sys.argv[split + 1 :]
        signum = getattr(signal, ns.signal)
        result = run_case(run_clm, ns.workdir, argv, ranks=ns.ranks, signum=signum, timeout=ns.timeout)
    else:
        result = run_cases(str(ns.workdir), json.loads(ns.cases.read_text()), ns.example, ns.timeout)
    print(json.dumps(result), flush=True)


def run_cases(workdir: str, cases: dict, example: str = "run_clm", timeout: float = 240.0) -> dict:
    """Every case (name -> {flags, ranks, signal}) into `workdir/<name>`: name -> result. Cases with the same command
    share one uninterrupted reference run (the first one's). Runs in the process that calls it (tests/warm.py forks
    one for it)."""
    torch.set_num_threads(1)
    run_clm = load_example(example)
    results, references = {}, {}
    for name, case in cases.items():
        key = (tuple(case["flags"]), case.get("ranks", 1))
        result = run_case(
            run_clm,
            Path(workdir) / name,
            case["flags"],
            ranks=case.get("ranks", 1),
            signum=getattr(signal, case.get("signal", "SIGKILL")),
            timeout=timeout,
            reference=references.get(key),
        )
        references.setdefault(key, (Path(result["reference"]), result["reference_exit"]))
        results[name] = result
    return results


if __name__ == "__main__":
    main()
