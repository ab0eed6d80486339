"""The callbacks on 2 real gloo ranks: manifests cover every rank's files, rotation, auto-resume, no deadlock, one
holder of the output folder's lock; a resume of that run on 1 rank is refused (the resume policy's ranks row)."""

from __future__ import annotations

import pytest

from hf_llmkit.callbacks import latest_complete_checkpoint
from hf_llmkit.checkpoints import ResumeError
from tests import warm
from tests.callbacks.multirank_support import _train, train_two_ranks


def test_two_ranks_checkpoint_rotate_and_resume(tmp_path):
    ranks = warm.launch(train_two_ranks, str(tmp_path), nprocs=2, timeout=300)  # ranks forked from tests/warm.py
    for result in ranks:
        assert result[4]["world_size"] == 2 and result[4]["global_step"] == 4
        assert result[6]["global_step"] == 6  # resumed from checkpoint-4 on both ranks
    first, second = ranks[0][4], ranks[0][6]
    assert {"rng_state_0.pth", "rng_state_1.pth", "adapter/adapter_model.safetensors"} <= set(first["manifest_files"])
    assert first["manifest_world_size"] == 2
    assert first["checkpoints"] == ["checkpoint-4"] and second["checkpoints"] == ["checkpoint-6"]
    assert latest_complete_checkpoint(tmp_path).endswith("checkpoint-6")
    assert ranks[0]["lock_pid"] == ranks[1]["lock_pid"] == ranks[0]["pid"]  # rank 0 holds the output folder
    # The same job on 1 rank cannot continue the 2 ranks' data order: refused, naming only the number of ranks.
    with pytest.raises(ResumeError, match=r"different run \(ranks: 2 -> 1\); resume with the recorded values"):
        _train(str(tmp_path), 8)
