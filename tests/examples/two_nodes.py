"""Two torchrun agents on this host, each its own "node" (`--nnodes 2 --nproc_per_node 1`), meeting through a c10d
rendezvous: what a two-machine launch does, with the network replaced by 127.0.0.1.

    with TwoNodes(script, args, logs=tmp / "run", env_per_node=[{...}, {...}]) as nodes:
        nodes.worker(rank=1).send_signal(signal.SIGKILL)
        codes = nodes.wait(timeout=240)

Each agent is torchrun itself (`torch.distributed.run.main`: its command line, its elastic agent, its c10d
rendezvous and restarts) in a child of the warm interpreter (tests/warm.py), run with `--run-path --start-method
fork`: the agent forks each worker, which runs the script as `__main__`, so no worker pays the 7-9 s of CPU a fresh
interpreter spends importing the stack (6 workers in a twice-killed run). A worker is still a process of its own
that its agent watches, stops and restarts; it notes its pid as the worker of its RANK (`two_nodes_worker.py`), so
a test can signal it. Leaving the `with` block kills whatever is still running (each agent with its workers).

The torchrun command as typed, two cold agents and their workers, runs in the docs test (docs/multi_node.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil

from hf_llmkit.parallel.elastic import SHARED_STORE_FIX
from hf_llmkit.testing import free_port

STORE_ENV = dict([SHARED_STORE_FIX.split("=")])  # each restart round gets its own store (see parallel/elastic.py)
WORKER = Path(__file__).with_name("two_nodes_worker.py")
# What tests/warm.py sets for a rank of its own jobs: an agent is no rank, torchrun sets its workers' own.
_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def node(argv: list[str], envs: list[dict[str, str]], logs: list[str], pids: str) -> int:
    """One node's agent (run in a child of the warm interpreter, RANK = the node's index): `torchrun argv` with
    the node's environment, its output and its workers' in its log; the agent's exit status."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    index = int(os.environ["RANK"])
    (Path(pids) / f"agent{index}-{os.getpid()}").touch()
    env = envs[index]
    handle = os.open(logs[index], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(handle, 1)
    os.dup2(handle, 2)
    for name in _RANK_ENV:
        os.environ.pop(name, None)
    os.environ.update(env)
    try:
        torchrun.main(argv)
    except ChildFailedError as err:  # what the `torchrun` command prints, then exit status 1
        print(err, file=sys.stderr)
        return 1
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


class TwoNodes:
    """`torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --max-restarts N script args`, twice."""

    def __init__(
        self,
        script: str | os.PathLike,
        args: list[str],
        *,
        logs: Path,
        max_restarts: int = 1,
        env_per_node: tuple[dict[str, str], dict[str, str]] = ({}, {}),
        store_fix: bool = True,
        timeout: float = 600.0,
    ):
        from tests import warm

        logs.parent.mkdir(parents=True, exist_ok=True)
        self.pids = logs.with_name(f"{logs.name}-pids")
        self.pids.mkdir()
        endpoint = f"127.0.0.1:{free_port()}"
        self.logs = [logs.with_name(f"{logs.name}-node{node}.log") for node in range(2)]
        base = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        base["TWO_NODES_WORKERS"] = str(self.pids)
        if store_fix:
            base.update(STORE_ENV)
        argv = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint]
        argv += ["--rdzv_id", logs.name, "--max-restarts", str(max_restarts), "--run-path", "--start-method", "fork"]
        argv += [str(WORKER), str(script), *args]
        envs = [{**base, **env_per_node[n]} for n in range(2)]
        self.codes: list[int] | None = None
        self.error: BaseException | None = None

        def agents() -> None:  # the two agents are one job of the warm interpreter: this thread waits for it
            try:
                self.codes = warm.launch(
                    f"{__name__}:node", argv, envs, [str(p) for p in self.logs], str(self.pids),
                    nprocs=2, timeout=timeout, init_process_group=False,
                )  # fmt: skip
            except BaseException as err:  # noqa: BLE001 - a killed agent: reported by `wait`
                self.error = err

        self._thread = threading.Thread(target=agents, daemon=True)
        self._thread.start()

    def __enter__(self) -> TwoNodes:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def running(self) -> bool:
        return self._thread.is_alive()

    def worker(self, *, rank: int, timeout: float = 60.0) -> psutil.Process:
        """A live worker process whose RANK is `rank` (started by either agent)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.running():
            for path in sorted(self.pids.glob(f"rank{rank}-*")):
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(int(path.name.split("-")[1]))
                    if proc.status() != psutil.STATUS_ZOMBIE:
                        return proc
            time.sleep(0.05)
        raise TimeoutError(f"no worker of rank {rank} appeared\n{self.output()[-4000:]}")

    def wait(self, *, timeout: float) -> list[int]:
        """Both agents' exit codes; past `timeout`, everything is killed and the codes are negative."""
        self._thread.join(timeout)
        self.kill()
        return self.codes if self.codes is not None else [-signal.SIGKILL] * 2

    def kill(self) -> None:
        """SIGKILL every agent and every worker it started that is still alive."""
        for path in self.pids.glob("agent*-*"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(path.name.split("-")[1]), signal.SIGKILL)  # an agent leads its workers' group
        self._thread.join()

    def output(self) -> str:
        return "\n".join(f"--- node {n} ---\n{log.read_text(errors='replace')}" for n, log in enumerate(self.logs))
