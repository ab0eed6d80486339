"""RunArguments switches hf_llmkit's callbacks on and off as its flags say."""

from __future__ import annotations

import pytest

from hf_llmkit.callbacks import FaultToleranceCallback, LossScaleCallback, SavePeftModelCallback
from hf_llmkit.cli.arguments import RunArguments


@pytest.mark.parametrize(
    ("flags", "peft", "fp16", "expected"),
    [
        ({}, False, False, [FaultToleranceCallback]),
        ({}, True, True, [FaultToleranceCallback, SavePeftModelCallback, LossScaleCallback]),
        ({"fault_tolerance": False}, True, False, [SavePeftModelCallback]),
        ({"save_peft_adapter": False, "log_loss_scale": False}, True, True, [FaultToleranceCallback]),
    ],
)
def test_build_callbacks_follows_the_flags(flags, peft, fp16, expected):
    callbacks = RunArguments(**flags).build_callbacks(peft=peft, fp16=fp16)
    assert [type(c) for c in callbacks] == expected
