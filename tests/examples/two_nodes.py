"""Two torchrun agents on this host, each its own "node" (`--nnodes 2 --nproc_per_node 1`), meeting through a c10d
rendezvous: what a two-machine launch does, with the network replaced by 127.0.0.1.

    with TwoNodes(script, args, logs=tmp / "run", env_per_node=[{...}, {...}]) as nodes:
        nodes.worker(rank=1).send_signal(signal.SIGKILL)
        codes = nodes.wait(timeout=240)

Every agent starts in its own session; leaving the `with` block kills whatever is still running (agents and the
workers they started in sessions of their own), so a failed test leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from hf_llmkit.parallel.elastic import SHARED_STORE_FIX
from hf_llmkit.testing import free_port

STORE_ENV = dict([SHARED_STORE_FIX.split("=")])  # each restart round gets its own store (see parallel/elastic.py)


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
    ):
        logs.parent.mkdir(parents=True, exist_ok=True)
        endpoint = f"127.0.0.1:{free_port()}"
        self.logs = [logs.with_name(f"{logs.name}-node{node}.log") for node in range(2)]
        self.agents: list[subprocess.Popen] = []
        base = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        if store_fix:
            base.update(STORE_ENV)
        for node in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
            cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", logs.name]
            cmd += ["--max-restarts", str(max_restarts), str(script), *args]
            with open(self.logs[node], "wb") as log:
                self.agents.append(
                    subprocess.Popen(
                        cmd,
                        env={**base, **env_per_node[node]},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    def __enter__(self) -> TwoNodes:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def running(self) -> bool:
        return any(agent.poll() is None for agent in self.agents)

    def worker(self, *, rank: int, timeout: float = 60.0) -> psutil.Process:
        """The live worker process whose RANK is `rank` (started by either agent)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.running():
            for agent in self.agents:
                for child in _children(agent.pid):
                    try:
                        if child.environ().get("RANK") == str(rank):
                            return child
                    except psutil.Error:  # exited or not yet exec'ed
                        continue
            time.sleep(0.05)
        raise TimeoutError(f"no worker of rank {rank} appeared\n{self.output()[-4000:]}")

    def wait(self, *, timeout: float) -> list[int]:
        """Both agents' exit codes; past `timeout`, everything is killed and the codes are negative."""
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.kill()
        return [agent.returncode for agent in self.agents]

    def kill(self) -> None:
        """SIGKILL every agent and every process it started that is still alive."""
        for agent in self.agents:
            if agent.poll() is None:
                for proc in [*_children(agent.pid), psutil.Process(agent.pid)]:
                    with contextlib.suppress(psutil.Error):
                        proc.send_signal(signal.SIGKILL)
            agent.wait()

    def output(self) -> str:
        return "\n".join(f"--- node {n} ---\n{log.read_text(errors='replace')}" for n, log in enumerate(self.logs))


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
