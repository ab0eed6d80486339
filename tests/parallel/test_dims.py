"""hf_llmkit.parallel.dims: the degrees dp x sp x ep are validated together, in one place, for every caller
(`LLMKitTrainingArguments`, the trainer's SP / EP set-ups, the group builders)."""

from __future__ import annotations

import pytest

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.parallel import ParallelDims


@pytest.mark.parametrize(
    ("world", "sp", "ep", "dp"), [(1, 1, 1, 1), (4, 2, 1, 2), (4, 1, 4, 1), (8, 1, 2, 4), (6, 3, 1, 2)]
)
def test_dp_is_what_the_other_degrees_leave(world, sp, ep, dp):
    assert ParallelDims(world=world, sp=sp, ep=ep).dp == dp


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world": 4, "sp": 3}, "sequence_parallel_size=3 must be >= 1 and divide the number of ranks (4)"),
        ({"world": 4, "sp": 0}, "sequence_parallel_size=0 must be >= 1"),
        ({"world": 2, "ep": 4}, "expert_parallel_size=4 must be >= 1 and divide the number of ranks (2)"),
        ({"world": 4, "sp": 2, "ep": 2}, "cannot be combined with sequence_parallel_size > 1; pick one"),
    ],
)
def test_bad_layouts_are_one_line_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelDims(**kwargs)


def test_the_training_arguments_check_the_degrees_together(tmp_path, monkeypatch):
    """sp and ep together are refused when the arguments are built, before a model or a trainer exists."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="cannot be combined with sequence_parallel_size"):
        LLMKitTrainingArguments(
            output_dir=str(tmp_path), sequence_parallel_size=2, expert_parallel_size=2, report_to="none"
        )
