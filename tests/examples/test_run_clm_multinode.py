"""More than one machine (issue 12 §5): two torchrun agents, each its own node with one worker, meet through a c10d
rendezvous and run the main job with sequence parallel 2 across the two nodes. With `--max-restarts`, a worker
SIGKILLed after a checkpoint makes the agents restart the whole group; the new workers resume from the last
complete checkpoint in the shared output folder and end with the final files of an uninterrupted run, byte for
byte. Each node has its own cache folder (tokenizer and tokenized blocks), built once on each node at the same time.
The slow cells share one two-node run killed twice: first a worker of rank 1 after a checkpoint, then, in the group
the agents restarted, rank 0 half way through a checkpoint; the uninterrupted run it is compared with is the same
command on two ranks forked from the warm interpreter (tests/warm.py). The agents are torchrun's own
(`torch.distributed.run`) in children of the warm interpreter, forking their workers (two_nodes.py): the six workers
start without importing the stack (the command as typed, cold, runs in the docs test). Output folders that not every
machine sees, and `--save_on_each_node` on several machines, stop before any work with one line.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from hf_llmkit.checkpoints.names import MANIFEST_NAME, WRITING_MARKER
from hf_llmkit.parallel.elastic import SHARED_STORE_FIX, check_elastic_restarts
from tests import warm
from tests.callbacks.clm_kill_harness import compare
from tests.conftest import EXAMPLES
from tests.examples.multinode_support import output_folder_checks
from tests.examples.test_run_clm import TINY
from tests.examples.two_nodes import TwoNodes

RUN_CLM = EXAMPLES / "run_clm.py"
# 8 steps, a checkpoint every 2, sequence parallel over the two nodes.
FLAGS = [*TINY, "--max_steps", "8", "--save_steps", "2", "--sequence_parallel_size", "2"]
TIMEOUT = 240.0  # per launch; a healthy one takes 5-30 s on 2 busy cores


def _reference(workdir: Path) -> Path:
    """The uninterrupted run: the same command on two ranks (forked from the warm interpreter, as torchrun's
    workers would be started: RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    out = workdir / "reference"
    ranks = warm.run_script_on_ranks(RUN_CLM, [*FLAGS, "--output_dir", str(out)], nprocs=2, timeout=TIMEOUT)
    assert [proc.returncode for proc in ranks] == [0, 0], [proc.stderr[-3000:] for proc in ranks]
    assert "| sequence parallel      | 2 ranks per sequence" in ranks[0].stdout
    return out


def _writes(out: Path) -> dict[str, tuple[int, int]]:
    """The checkpoint folders being written now (a writing marker, no manifest yet): name -> the marker's identity."""
    found = {}
    for folder in out.glob("checkpoint-*"):
        try:
            if not (folder / MANIFEST_NAME).is_file():
                marker = (folder / WRITING_MARKER).stat()
                found[folder.name] = (marker.st_ino, marker.st_mtime_ns)
        except OSError:  # no marker (yet, or any more)
            continue
    return found


def _wait_for_checkpoint(out: Path, nodes: TwoNodes, *, writing: bool, old: dict | None = None) -> str:
    """Wait until a checkpoint is complete (or, with `writing`, until one is being written after a complete one and
    its write is not one of `old`: a write a killed group left behind)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and nodes.running():
        complete = [p for p in out.glob("checkpoint-*") if (p / MANIFEST_NAME).is_file()]
        if complete and not writing:
            return min(complete, key=lambda p: int(p.name.split("-")[1])).name
        new = {name for name, marker in _writes(out).items() if (old or {}).get(name) != marker}
        if complete and new:
            return min(new, key=lambda name: int(name.split("-")[1]))
        time.sleep(0.002)
    raise AssertionError(f"no checkpoint to interrupt\n{nodes.output()[-6000:]}")


def _worker_not_in(nodes: TwoNodes, rank: int, old: set[int]) -> psutil.Process:
    """The live worker of `rank` that the agents started after the processes `old` (the restarted group's)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        worker = nodes.worker(rank=rank, timeout=TIMEOUT)
        if worker.pid not in old:
            return worker
        time.sleep(0.05)
    raise AssertionError(f"the agents started no new worker of rank {rank}\n{nodes.output()[-6000:]}")


def _killed_twice(workdir: Path) -> dict:
    """One two-node run with two restarts: rank 1 SIGKILLed once a checkpoint is complete; then, in the restarted
    group, rank 0 SIGKILLed while it writes a checkpoint after a complete one."""
    out = workdir / "resumed"
    caches = [workdir / f"node{node}-cache" for node in range(2)]  # node-local disks
    env = ({"HF_LLMKIT_CACHE": str(caches[0])}, {"HF_LLMKIT_CACHE": str(caches[1])})
    logs = workdir / "logs" / "killed"
    args = [*FLAGS, "--output_dir", str(out)]
    with TwoNodes(RUN_CLM, args, logs=logs, env_per_node=env, max_restarts=2) as nodes:
        first = [nodes.worker(rank=rank, timeout=TIMEOUT) for rank in (0, 1)]
        at = _wait_for_checkpoint(out, nodes, writing=False)
        first[1].send_signal(signal.SIGKILL)
        victim = _worker_not_in(nodes, 0, {worker.pid for worker in first})
        psutil.wait_procs(first, timeout=TIMEOUT)  # the first group is gone (the agents stop it before a restart)
        left = _writes(out)  # what it may have left half written (the restarted group drops it)
        at_write = _wait_for_checkpoint(out, nodes, writing=True, old=left)
        victim.send_signal(signal.SIGKILL)
        late = (out / at_write / MANIFEST_NAME).is_file()  # the write finished before the signal landed
        first_restart = nodes.output()  # the second group's resume is logged (before it trained), not the third's
        codes = nodes.wait(timeout=TIMEOUT)
        output = nodes.output()
    assert codes == [0, 0], output[-8000:]
    # The first restart: every rank of the second group logged the checkpoint it resumed from (the same one); the
    # second: world rank 0's table at the end of the third group.
    restarted = sorted(set(re.findall(r"resuming from the latest complete checkpoint \S*-(\d+)\n", first_restart)))
    resumed = re.findall(r"\| steps +\| 8 \(resumed at step (\d+)\)", output)
    return {"out": out, "at": at, "at_write": at_write, "late": late, "restarted": restarted, "resumed": resumed,
            "output": output, "caches": caches}  # fmt: skip


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory) -> tuple[Path, dict]:
    workdir = tmp_path_factory.mktemp("two_nodes")
    return _reference(workdir), _killed_twice(workdir)


def _check_final_files(reference: Path, run: dict) -> None:
    assert "resuming from the latest complete checkpoint" in run["output"]
    comparison = compare(reference, run["out"])
    weights = [name for name in comparison["files"] if name.endswith(".safetensors")]
    assert weights and comparison["missing"] == comparison["extra"] == [], comparison
    assert comparison["differing"] == {}, comparison
    leftovers = [p.name for p in run["out"].iterdir() if p.name.startswith("checkpoint-")]
    assert leftovers and all((run["out"] / name / MANIFEST_NAME).is_file() for name in leftovers), leftovers
    for cache in run["caches"]:  # each node built its cache once, atomically, and reused it after the restarts
        blocks = sorted(p.name for p in (cache / "datasets").iterdir())
        assert len(blocks) == 1 and blocks[0].startswith("lm-blocks-") and ".tmp-" not in blocks[0], blocks


@pytest.mark.slow  # 2 agents, 6 forked workers (~20 s), shared with the next cell; the output-folder and store
def test_two_nodes_sequence_parallel_survive_a_killed_worker(killed_twice):  # checks stay in `make test`
    reference, run = killed_twice
    assert len(run["restarted"]) == 1, run["output"][-6000:]  # the restarted group resumed, every rank from one
    step = int(run["restarted"][0])
    assert 2 <= step < 8, run["restarted"]
    assert run["resumed"], run["output"][-6000:]  # ... and so did the group restarted after it (world rank 0's table)
    _check_final_files(reference, run)


@pytest.mark.slow
def test_two_nodes_rank0_killed_while_writing_a_checkpoint(killed_twice):
    """The rank that writes manifests dies half way through a checkpoint: the restart drops that write and resumes
    from the complete one before it."""
    reference, run = killed_twice
    assert run["resumed"], run["output"][-6000:]  # the group restarted after the kill resumed (world rank 0's table)
    interrupted = int(run["at_write"].split("-")[1])
    assert int(run["resumed"][0]) < interrupted or run["late"], (run["at_write"], run["resumed"])
    _check_final_files(reference, run)


def test_output_folders_of_two_machines_are_checked_before_any_work(tmp_path):
    """Two gloo ranks, each with its own output folder (a machine's local disk) or one shared folder: the
    combinations that would lose or double-write checkpoint files stop with one line; a resume uses rank 0's
    checkpoint on every rank."""
    first, second = warm.launch(output_folder_checks, str(tmp_path), nprocs=2, timeout=180)  # forked gloo ranks
    for outcome in (first, second):
        assert outcome["shared folder"] == "ok: None", outcome
        assert "rank 1 does not see the files rank 0 writes" in outcome["own folders"], outcome
        assert "put --output_dir on a filesystem every machine mounts" in outcome["own folders"]
        assert "drop --save_on_each_node" in outcome["shared folder, save_on_each_node"], outcome
        assert outcome["shared folder, one saver, save_on_each_node"] == "ok: None", outcome  # one machine
        assert outcome["resume"] == "ok: checkpoint-4", outcome  # rank 1's newer checkpoint-6 is not used
        assert "rank 1 has no complete copy of it" in outcome["resume, rank 1 without it"], outcome
        assert all("\n" not in text for text in outcome.values())


def test_restarts_with_a_shared_agent_store_are_refused_with_the_fix(monkeypatch):
    torchrun = {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(ValueError, match=re.escape(SHARED_STORE_FIX)) as err:
        check_elastic_restarts(torchrun)
    assert "\n" not in str(err.value)
    check_elastic_restarts({**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "False"})  # the fix applied
    check_elastic_restarts({**torchrun, "TORCHELASTIC_MAX_RESTARTS": "0"})  # no restart, no stale store
    check_elastic_restarts({})  # not under torchrun
    from hf_llmkit import LLMKitTrainingArguments

    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        LLMKitTrainingArguments("unused", report_to="none")
