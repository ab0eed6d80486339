"""A warm interpreter for tests that need a process of their own (a fresh-process reload, a script's exit status,
a rank of a gloo group, a harness that forks and kills training runs).

Starting `python` and importing the stack (torch, transformers, peft, bitsandbytes, datasets, accelerate, DeepSpeed)
costs 7-9 s of CPU, far more than most such jobs. So each pytest process starts ONE interpreter, on first use, that
imports the stack and nothing else, and forks a child per rank of each job: a child is a freshly imported interpreter
(no model, adapter, registry edit or cached file of the test process or of an earlier job is in it), its output goes
to its own files, and its exit status is its own.

    ranks = launch(fn, *args, nprocs=2)           # hf_llmkit.testing.launch's contract, on forked ranks
    result = call(fn, *args)                      # one child, no process group: fn's result
    proc = run_script(path, args)                 # `python path args`: exit status, stdout, stderr
    procs = run_script_on_ranks(path, args)       # the same on 2 ranks, as `torchrun --nproc-per-node 2` runs it

`fn` must be importable by module and name and its arguments and result picklable, as for `hf_llmkit.testing.launch`
(the child imports `fn`'s module itself); `"package.module:function"` names one without importing it here. A job
that outlives its timeout is killed with everything it started.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

_server: subprocess.Popen | None = None
_server_log: Path | None = None


def _start() -> subprocess.Popen:
    global _server, _server_log
    if _server is not None and _server.poll() is None:
        return _server
    folder = Path(tempfile.mkdtemp(prefix="hf_llmkit_warm_"))
    _server_log = folder / "server.log"
    with open(_server_log, "wb") as log:
        _server = subprocess.Popen(
            [sys.executable, "-m", "tests.warm"],
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
    atexit.register(_stop, _server)
    return _server


def _stop(server: subprocess.Popen) -> None:
    """End the server and wait for it (a waited-for child's CPU time counts in the test process's own)."""
    if server.poll() is None:
        server.stdin.close()  # the server leaves when its input ends
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _submit(request: dict, timeout: float) -> dict:
    """Hand `request` to the server and wait for its answer (every child's exit status)."""
    server = _start()
    path = Path(request["workdir"]) / "request.pkl"
    path.write_bytes(pickle.dumps(request))
    server.stdin.write(f"{path}\n".encode())
    server.stdin.flush()
    deadline = time.monotonic() + timeout + 60  # the server kills a late job itself at `timeout`
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        ready, _, _ = select.select([server.stdout], [], [], max(left, 0))
        chunk = os.read(server.stdout.fileno(), 4096) if ready else b""
        if not chunk:  # the server died (or hangs): start a new one for the next job
            server.kill()
            server.wait()
            tail = _server_log.read_text(errors="replace")[-4000:] if _server_log else ""
            raise RuntimeError(f"the warm interpreter (tests/warm.py) gave no answer\n{tail}")
        line += chunk
    return json.loads(line)


def _child_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.update(extra or {})
    return env


def launch(
    fn: Callable[..., Any] | str,
    *args: Any,
    nprocs: int = 2,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    init_process_group: bool = True,
) -> list[Any]:
    """`hf_llmkit.testing.launch` on ranks forked from the warm interpreter: `fn(*args)` on `nprocs` ranks (RANK,
    WORLD_SIZE, MASTER_* set; with `init_process_group` a gloo group around it), the results in rank order;
    `DistributedRunError` with every rank's output when one fails or the job runs past `timeout`."""
    from hf_llmkit.testing import DistributedRunError, distributed_backend, free_port

    module, name = fn.split(":") if isinstance(fn, str) else (fn.__module__, fn.__qualname__)
    if module == "__main__" or "<locals>" in name:
        raise ValueError(f"launch() needs a function defined at module top level, got {module}.{name}")
    with tempfile.TemporaryDirectory(prefix="hf_llmkit_warm_job_") as tmp:
        request = dict(
            kind="function",
            target=(module, name, args),
            backend=distributed_backend(nprocs) if init_process_group else None,
            nprocs=nprocs,
            port=free_port(),
            env=_child_env(env),
            cwd=os.getcwd(),
            workdir=tmp,
            timeout=timeout,
            merge_output=True,
        )
        answer = _submit(request, timeout)
        codes = answer["codes"]
        if answer["timed_out"] or any(code != 0 for code in codes):
            reason = f"timed out after {timeout:.0f}s" if answer["timed_out"] else "failed"
            parts = [f"{module}.{name} {reason} on {nprocs} ranks (forked from tests/warm.py)"]
            for rank, code in enumerate(codes):
                tail = (Path(tmp) / f"out{rank}").read_text(errors="replace")[-6000:]
                parts.append(f"--- rank {rank} (exit code {code}) output ---\n{tail}")
            raise DistributedRunError("\n".join(parts))
        return [pickle.loads((Path(tmp) / f"result{rank}.pkl").read_bytes()) for rank in range(nprocs)]


def call(fn: Callable[..., Any] | str, *args: Any, timeout: float = 300.0, env: dict[str, str] | None = None) -> Any:
    """`fn(*args)` in one child of the warm interpreter (no process group): its result."""
    return launch(fn, *args, nprocs=1, timeout=timeout, env=env, init_process_group=False)[0]


def run_script(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    honour_permissions: bool = False,
) -> subprocess.CompletedProcess:
    """What `subprocess.run([python, script, *args], capture_output=True, text=True)` gives, from a child of the warm
    interpreter: the script runs as `__main__` with its folder first on `sys.path`; an uncaught exception prints its
    traceback and exits 1, `SystemExit` exits with its status. `honour_permissions`: run as root, the child gives up
    the capabilities that let root write anywhere (tests/cli/permissions.py), so permission bits apply to it.
    A script past `timeout` is killed (exit status -9)."""
    return _scripts(script, args, 1, timeout, env, cwd, honour_permissions)[0]


def run_script_on_ranks(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    nprocs: int = 2,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[subprocess.CompletedProcess]:
    """`run_script` on `nprocs` ranks with the environment `torchrun --nproc-per-node N` gives each (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...): each rank's exit status and output. As torchrun does, a rank that
    fails takes the others down (here after 2 s, SIGKILL)."""
    return _scripts(script, args, nprocs, timeout, env, None, False)


def torchrun(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    nprocs: int = 2,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess:
    """`hf_llmkit.testing.launch_script(..., launcher="torchrun")`'s contract on forked ranks (for tests whose subject
    is the script, not the launcher): every rank's output in `.stdout`, rank order; `DistributedRunError` with it
    when a rank fails or the job runs past `timeout`."""
    from hf_llmkit.testing import DistributedRunError

    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})}
    procs = _scripts(script, args, nprocs, timeout, env, cwd, False)
    text = "".join(p.stdout + p.stderr for p in procs)
    codes = [p.returncode for p in procs]
    if any(codes):
        raise DistributedRunError(f"{script} on {nprocs} forked ranks: exit codes {codes}\n{text[-12000:]}")
    return subprocess.CompletedProcess(procs[0].args, 0, stdout=text, stderr="")


def _scripts(script, args, nprocs, timeout, env, cwd, honour_permissions) -> list[subprocess.CompletedProcess]:
    from hf_llmkit.testing import free_port

    with tempfile.TemporaryDirectory(prefix="hf_llmkit_warm_job_") as tmp:
        request = dict(
            kind="script",
            target=(str(Path(script).resolve()), [str(a) for a in args]),
            nprocs=nprocs,
            port=free_port(),
            env={**dict(os.environ), **(env or {})},
            cwd=str(cwd or os.getcwd()),
            workdir=tmp,
            timeout=timeout,
            merge_output=False,
            honour_permissions=honour_permissions,
        )
        answer = _submit(request, timeout)
        command = [sys.executable, str(script), *args]
        return [
            subprocess.CompletedProcess(
                command,
                code,
                (Path(tmp) / f"out{rank}").read_text(errors="replace"),
                (Path(tmp) / f"err{rank}").read_text(errors="replace"),
            )
            for rank, code in enumerate(answer["codes"])
        ]


# ---- the server (`python -m tests.warm`) ----


def _preload() -> None:
    """The stack every job uses, imported once: peft, then hf_llmkit, which registers its plugins with peft's tables
    already built (what tests/tuners/test_registration.py reloads under; hf_llmkit imports peft first itself, so a
    child sees the same registrations either way)."""
    import importlib.util

    import peft  # noqa: F401  (first: see above)

    import hf_llmkit  # noqa: F401
    import hf_llmkit.callbacks  # noqa: F401
    import hf_llmkit.cli.job  # noqa: F401
    import hf_llmkit.testing  # noqa: F401
    import hf_llmkit.trainers  # noqa: F401
    import tests.conftest  # noqa: F401  (its temporary folder is the server's, removed when it leaves)

    if importlib.util.find_spec("deepspeed"):  # accelerate imports it lazily: once here, not in every job
        import deepspeed  # noqa: F401
    import pydoc_data.topics  # noqa: F401  (the embedded corpus)

    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  (the tiny models' classes, loaded lazily)
    import transformers.models.mixtral.modeling_mixtral  # noqa: F401
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    # transformers builds its table of weight renamings (900 regular expressions, 0.1-0.4 s) at a process's first
    # save or load of a model: once here, as a fresh process would build it, not in every job.
    get_checkpoint_conversion_mapping("llama")

    torch.set_num_threads(1)


def _child(request: dict, rank: int) -> None:
    """One forked rank: runs the job's target with its environment and output files, then leaves with its status."""
    code = 0
    try:
        os.setsid()  # its own process group: a timeout kills what it started too
        work = Path(request["workdir"])
        out = os.open(work / f"out{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = out if request["merge_output"] else os.open(work / f"err{rank}", os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if request["kind"] == "function" or request["nprocs"] > 1:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(request["nprocs"]),
                LOCAL_WORLD_SIZE=str(request["nprocs"]),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(request["port"]),
            )
        if request["kind"] == "function":
            _run_function(request, rank)
        else:
            _run_script(request)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter does: a traceback and status 1
        import traceback

        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _run_function(request: dict, rank: int) -> None:
    import importlib

    import torch.distributed as dist

    module, name, args = request["target"]
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    if request["backend"] is not None:
        if "nccl" in request["backend"]:
            import torch

            torch.cuda.set_device(rank)
        dist.init_process_group(request["backend"])
    try:
        result = fn(*args)
        if dist.is_initialized():  # rank 0 hosts the store: it waits until every rank is done with it
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (Path(request["workdir"]) / f"result{rank}.pkl").write_bytes(pickle.dumps(result))


def _run_script(request: dict) -> None:
    import runpy

    if request["honour_permissions"]:
        from tests.cli.permissions import give_up_override_capabilities

        give_up_override_capabilities()
    script, args = request["target"]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


def _wait(pids: list[int], timeout: float) -> tuple[list[int], bool]:
    """Every child's exit status; a failed rank gives its peers 2 s to print their own error, then they are killed;
    past `timeout` everything still running is killed."""
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    failed_at = None
    timed_out = False
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        if failed_at is None and any(code != 0 for code in codes.values()):
            failed_at = time.monotonic()
        now = time.monotonic()
        if len(codes) < len(pids) and (now > deadline or (failed_at is not None and now > failed_at + 2.0)):
            timed_out = now > deadline
            for pid in pids:
                if pid not in codes:
                    _kill_group(pid)
                    codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.01)
    for pid in pids:  # whatever a child left running in its group (a harness's own children)
        _kill_group(pid)
    return [codes[pid] for pid in pids], timed_out


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def serve() -> None:
    reply = os.dup(1)
    os.dup2(2, 1)  # what the imports print goes to the server's log, never into the answers
    _preload()
    # What the imports made is never collected in a child: a full collection there (accelerate runs one per Trainer)
    # would walk the whole imported stack and copy every page it touches.
    gc.freeze()
    for line in sys.stdin:
        request = pickle.loads(Path(line.strip()).read_bytes())
        pids = []
        sys.stdout.flush()
        sys.stderr.flush()
        for rank in range(request["nprocs"]):
            pid = os.fork()
            if pid == 0:
                _child(request, rank)
            pids.append(pid)
        codes, timed_out = _wait(pids, request["timeout"])
        os.write(reply, (json.dumps({"codes": codes, "timed_out": timed_out}) + "\n").encode())
    # The test process is done: clean up (atexit) and leave without tearing the imported stack down one module at a
    # time (seconds on a busy machine, while the test process waits to count this process's CPU time).
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    serve()
