"""Shared by tests, benchmarks and examples: a multi-rank launcher and tiny model / corpus factories (the factories
live in `hf_llmkit.testing_models`; every name is importable from here).

`launch(fn, nprocs=2)` runs an importable function on N real `torch.distributed` ranks on 127.0.0.1 (gloo; with
NCCL for CUDA tensors when the machine has a GPU per rank, see `distributed_backend`) and returns every rank's
result; `launch_script(path, nprocs=2)` does the same for a script under `torchrun` or `accelerate launch`. Both
pick a free port, bound the run in time, and raise `DistributedRunError` with every rank's stderr when a rank fails
or hangs.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hf_llmkit.data.corpus import corpus_texts, corpus_tokenizer
from hf_llmkit.testing_models import (  # noqa: F401 - the constants: importable from here, as before the split
    SMOLLM2_GGUF,
    SMOLLM2_PACKAGE,
    TINY_FAMILIES,
    TINY_SHAPE,
    minilm_path,
    smollm2_path,
    tiny_config,
    tiny_llama,
    tiny_llama_config,
    tiny_model,
    tiny_training_args,
)

__all__ = [
    "DistributedRunError",
    "corpus_texts",
    "corpus_tokenizer",
    "distributed_backend",
    "free_port",
    "launch",
    "launch_script",
    "minilm_path",
    "smollm2_path",
    "tiny_config",
    "tiny_llama",
    "tiny_llama_config",
    "tiny_model",
    "tiny_training_args",
]


class DistributedRunError(RuntimeError):
    """A multi-rank run failed or timed out; the message holds every rank's exit code and stderr tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def distributed_backend(nprocs: int) -> str:
    """The process-group backend for `nprocs` ranks on this machine: `"cpu:gloo,cuda:nccl"` when there is a CUDA
    device per rank and torch has NCCL (CUDA tensors go through NCCL, CPU tensors still through gloo), else `"gloo"`.
    """
    import torch
    import torch.distributed as dist

    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def _rank_env(rank: int, world_size: int, port: int, extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
    )
    env.update(extra or {})
    return env


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float, what: str) -> None:
    """Wait for every rank; on a failure or timeout kill the rest and raise with all stderr."""
    deadline = time.monotonic() + timeout
    failed = timed_out = False
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            timed_out = True
            break
        if any(p.poll() not in (None, 0) for p in procs):
            failed = True
            grace = time.monotonic() + 2.0  # let the peers print their own error before they are killed (a peer
            while any(p.poll() is None for p in procs) and time.monotonic() < grace:  # that ends sooner: no wait)
                time.sleep(0.05)
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    if timed_out or failed or any(p.returncode != 0 for p in procs):
        reason = f"timed out after {timeout:.0f}s" if timed_out else "failed"
        parts = [f"{what} {reason} on {len(procs)} ranks"]
        for rank, (p, log) in enumerate(zip(procs, logs)):
            tail = log.read_text(errors="replace")[-6000:]
            parts.append(f"--- rank {rank} (exit code {p.returncode}) stderr ---\n{tail}")
        raise DistributedRunError("\n".join(parts))


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int = 2,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    init_process_group: bool = True,
) -> list[Any]:
    """Run `fn(*args)` on `nprocs` ranks and return the per-rank results (rank order).

    `fn` must be importable by module and name (defined at a module's top level) and its arguments and
    result picklable. Each rank is a fresh interpreter with RANK/WORLD_SIZE/MASTER_* set; with
    `init_process_group` the group (`distributed_backend(nprocs)`: gloo, plus NCCL for CUDA tensors when there is a
    GPU per rank, each rank then on `cuda:RANK`) is created before `fn` runs and destroyed after.
    """
    module, name = fn.__module__, fn.__qualname__
    if module == "__main__" or "<locals>" in name:
        raise ValueError(f"launch() needs a function defined at module top level, got {module}.{name}")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="hf_llmkit_launch_") as tmp:
        work = Path(tmp)
        backend = distributed_backend(nprocs) if init_process_group else None
        (work / "call.pkl").write_bytes(pickle.dumps((module, name, args, backend)))
        procs, logs = [], []
        for rank in range(nprocs):
            log = work / f"rank{rank}.stderr"
            logs.append(log)
            cmd = [sys.executable, "-m", "hf_llmkit.testing", str(work)]
            with open(log, "wb") as err:
                procs.append(
                    subprocess.Popen(cmd, env=_rank_env(rank, nprocs, port, env), stdout=err, stderr=subprocess.STDOUT)
                )
        _wait_all(procs, logs, timeout, f"{module}.{name}")
        return [pickle.loads((work / f"result{rank}.pkl").read_bytes()) for rank in range(nprocs)]


def launch_script(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    nprocs: int = 2,
    launcher: str = "torchrun",
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess:
    """Run a script on `nprocs` CPU ranks with `torchrun` or `accelerate launch` (MULTI_CPU, gloo).

    Returns the completed launcher process (stdout and stderr merged into `.stdout`); raises
    `DistributedRunError` with the output when it fails or runs past `timeout`.
    """
    port = free_port()
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}"]
        cmd += ["--master-addr=127.0.0.1", f"--master-port={port}"]
    elif launcher == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nprocs}"]
        cmd += ["--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={port}"]
    else:
        raise ValueError(f"launcher must be 'torchrun' or 'accelerate', got {launcher!r}")
    cmd += [str(script), *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    full_env.update(env or {})
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            cmd, env=full_env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        out.seek(0)
        text = out.read().decode(errors="replace")
    if proc.returncode != 0:
        reason = f"exit code {proc.returncode}" if proc.returncode > 0 else f"killed (timeout {timeout:.0f}s?)"
        raise DistributedRunError(f"{launcher} {script} on {nprocs} ranks: {reason}\n{text[-12000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout=text, stderr="")


def _worker(work: Path) -> None:
    """Entry point of one rank started by `launch` (`python -m hf_llmkit.testing WORKDIR`)."""
    import torch.distributed as dist

    module, name, args, backend = pickle.loads((work / "call.pkl").read_bytes())
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    if backend is not None:
        if "nccl" in backend:  # one GPU per rank, before the group exists (NCCL binds a communicator to it)
            import torch

            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
    try:
        result = fn(*args)
        if dist.is_initialized():  # rank 0 hosts the store: it stays until every rank is done with it (a subgroup
            dist.barrier()  # only rank 1 belongs to is still connecting through it when rank 0 returns)
    finally:
        if dist.is_initialized():  # also groups `fn` created itself (e.g. through the Trainer): exit cleanly
            dist.destroy_process_group()
    (work / f"result{os.environ['RANK']}.pkl").write_bytes(pickle.dumps(result))
    # The result is on disk: leave without interpreter finalisation, where a process group some library still
    # references (DeepSpeed's, a sequence-parallel one) is destroyed last and gloo can abort the rank ("terminate
    # called without an active exception", seen once in a CI rehearsal of the sequence-parallel benchmark).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _main(work: Path) -> None:
    """`_worker`, and on an error what the interpreter does for an uncaught one (the installed excepthook prints the
    traceback, status 1; `SystemExit` its status), then leave without finalisation as on success: tearing down the
    imported stack takes seconds on a busy machine, and a process group destroyed there can abort the rank."""
    code = 0
    try:
        _worker(work)  # leaves with os._exit(0) once its result is on disk
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:  # sys.exit("message")
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter does, then status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
