"""More than one machine (issue 12 §5): two torchrun agents, each its own node with one worker, meet through a c10d
rendezvous and run the main job with sequence parallel 2 across the two nodes. With `--max-restarts 1`, a worker
SIGKILLed after a checkpoint makes the agents restart the whole group; the new workers resume from the last
complete checkpoint in the shared output folder and end with the final files of an uninterrupted run, byte for
byte. Each node has its own cache folder (tokenizer and tokenized blocks), built once on each node at the same time.
The slow cell kills rank 0 half way through a checkpoint. Output folders that not every machine sees, and
`--save_on_each_node` on several machines, stop before any work with one line.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from hf_llmkit.checkpoints.names import MANIFEST_NAME, WRITING_MARKER
from hf_llmkit.parallel.elastic import SHARED_STORE_FIX, check_elastic_restarts
from hf_llmkit.testing import launch
from tests.callbacks.clm_kill_harness import compare
from tests.conftest import EXAMPLES, REPO
from tests.examples.multinode_support import output_folder_checks
from tests.examples.test_run_clm import TINY
from tests.examples.two_nodes import TwoNodes

RUN_CLM = EXAMPLES / "run_clm.py"
# 8 steps, a checkpoint every 2, sequence parallel over the two nodes.
FLAGS = [*TINY, "--max_steps", "8", "--save_steps", "2", "--sequence_parallel_size", "2"]
TIMEOUT = 240.0  # per launch; a healthy one takes 20-60 s on 2 busy cores


def _reference(workdir: Path) -> Path:
    out = workdir / "reference"
    with TwoNodes(RUN_CLM, [*FLAGS, "--output_dir", str(out)], logs=workdir / "logs" / "reference") as nodes:
        codes = nodes.wait(timeout=TIMEOUT)
        assert codes == [0, 0], nodes.output()[-6000:]
        assert "| sequence parallel      | 2 ranks per sequence" in nodes.output()
    return out


def _first_checkpoint(out: Path, nodes: TwoNodes, *, writing: bool) -> str:
    """Wait until a checkpoint is complete (or, with `writing`, until one is being written after a complete one)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and nodes.running():
        folders = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        complete = [p for p in folders if (p / MANIFEST_NAME).is_file()]
        if complete and not writing:
            return complete[0].name
        being_written = [p for p in folders if (p / WRITING_MARKER).is_file() and not (p / MANIFEST_NAME).is_file()]
        if complete and being_written:
            return being_written[0].name
        time.sleep(0.002)
    raise AssertionError(f"no checkpoint to interrupt after\n{nodes.output()[-6000:]}")


def _killed_and_restarted(workdir: Path, *, rank: int, during_write: bool) -> dict:
    out = workdir / "resumed"
    caches = [workdir / f"node{node}-cache" for node in range(2)]  # node-local disks
    env = ({"HF_LLMKIT_CACHE": str(caches[0])}, {"HF_LLMKIT_CACHE": str(caches[1])})
    logs = workdir / "logs" / "killed"
    with TwoNodes(RUN_CLM, [*FLAGS, "--output_dir", str(out)], logs=logs, env_per_node=env) as nodes:
        victim = nodes.worker(rank=rank)
        at = _first_checkpoint(out, nodes, writing=during_write)
        victim.send_signal(signal.SIGKILL)
        late = (out / at / MANIFEST_NAME).is_file()  # the write finished before the signal landed
        codes = nodes.wait(timeout=TIMEOUT)
        output = nodes.output()
    assert codes == [0, 0], output[-8000:]
    resumed = re.findall(r"\| steps +\| 8 \(resumed at step (\d+)\)", output)
    return {"out": out, "at": at, "late": late, "resumed": resumed, "output": output, "caches": caches}


def _check_restart(reference: Path, run: dict) -> None:
    assert run["resumed"], run["output"][-6000:]  # the restarted group resumed (the table of world rank 0)
    step = int(run["resumed"][0])
    assert 2 <= step < 8, run["resumed"]
    assert "resuming from the latest complete checkpoint" in run["output"]
    comparison = compare(reference, run["out"])
    weights = [name for name in comparison["files"] if name.endswith(".safetensors")]
    assert weights and comparison["missing"] == comparison["extra"] == [], comparison
    assert comparison["differing"] == {}, comparison
    leftovers = [p.name for p in run["out"].iterdir() if p.name.startswith("checkpoint-")]
    assert leftovers and all((run["out"] / name / MANIFEST_NAME).is_file() for name in leftovers), leftovers
    for cache in run["caches"]:  # each node built its cache once, atomically, and reused it after the restart
        blocks = sorted(p.name for p in (cache / "datasets").iterdir())
        assert len(blocks) == 1 and blocks[0].startswith("lm-blocks-") and ".tmp-" not in blocks[0], blocks


@pytest.mark.slow  # 2 agents, 6 workers (~70 s); the output-folder and restart-store checks stay in `make test`
def test_two_nodes_sequence_parallel_survive_a_killed_worker(tmp_path):
    reference = _reference(tmp_path)
    run = _killed_and_restarted(tmp_path, rank=1, during_write=False)
    _check_restart(reference, run)


@pytest.mark.slow
def test_two_nodes_rank0_killed_while_writing_a_checkpoint(tmp_path):
    """The rank that writes manifests dies half way through a checkpoint: the restart drops that write and resumes
    from the complete one before it."""
    reference = _reference(tmp_path)
    run = _killed_and_restarted(tmp_path, rank=0, during_write=True)
    _check_restart(reference, run)
    interrupted = int(run["at"].split("-")[1])
    assert int(run["resumed"][0]) < interrupted or run["late"], (run["at"], run["resumed"])


def test_output_folders_of_two_machines_are_checked_before_any_work(tmp_path):
    """Two gloo ranks, each with its own output folder (a machine's local disk) or one shared folder: the
    combinations that would lose or double-write checkpoint files stop with one line; a resume uses rank 0's
    checkpoint on every rank."""
    first, second = launch(output_folder_checks, str(tmp_path), nprocs=2, timeout=180, env={"PYTHONPATH": str(REPO)})
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
