"""Rank functions for `hf_llmkit.testing.launch`: the output-folder checks of a run on several machines, on two real
gloo ranks whose output folders are one shared folder or one folder each (a machine's local disk). The arguments
are plain namespaces with the three fields the checks read, so one pair of ranks can play each layout."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from hf_llmkit.checkpoints import ResumeError
from hf_llmkit.checkpoints.manifest import write_manifest
from hf_llmkit.trainers.multi_node import agree_on_checkpoint, check_output_dir_sharing


def _outcome(check) -> str:
    try:
        result = check()
    except ResumeError as err:
        return f"refused: {err}"
    return f"ok: {result}"


def _checkpoint(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": int(folder.name.split("-")[1])}))
    write_manifest(folder)


def output_folder_checks(workdir: str) -> dict[str, str]:
    """Each case's outcome on this rank ("ok: ..." or "refused: <the one line>")."""
    rank, root = dist.get_rank(), Path(workdir)
    shared, own = root / "shared", root / f"node{rank}"
    first_saves = {"should_save": rank == 0, "save_on_each_node": False}
    cases = {
        "shared folder": SimpleNamespace(output_dir=str(shared), **first_saves),
        "own folders": SimpleNamespace(output_dir=str(own), **first_saves),
        "shared folder, save_on_each_node": SimpleNamespace(
            output_dir=str(shared), should_save=True, save_on_each_node=True
        ),  # two machines: each one's first process saves
        "shared folder, one saver, save_on_each_node": SimpleNamespace(
            output_dir=str(shared), should_save=rank == 0, save_on_each_node=True
        ),  # one machine with two processes
    }
    outcome = {name: _outcome(lambda args=args: check_output_dir_sharing(args)) for name, args in cases.items()}
    # Resume: rank 0 holds checkpoint-2 and -4; rank 1 holds -2, -4 and a newer -6 (rank 0 decides: -4).
    steps = {0: (2, 4), 1: (2, 4, 6)}[rank]
    for step in steps:
        _checkpoint(own / f"checkpoint-{step}")
    found = str(own / f"checkpoint-{steps[-1]}")
    outcome["resume"] = _outcome(lambda: Path(agree_on_checkpoint(cases["own folders"], found)).name)
    if rank == 1:  # rank 1 loses the checkpoint rank 0 resumes from
        (own / "checkpoint-4" / "trainer_state.json").write_text("{}")
    outcome["resume, rank 1 without it"] = _outcome(lambda: agree_on_checkpoint(cases["own folders"], found))
    return outcome
