"""What the lifecycle battery's checks share: outputs, one training step, one-line refusals, fresh-process reloads."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import AuxiliaryTrainingWrapper
from torch import nn

from tests import warm
from tests.tuners.lifecycle_cases import make_model


def outputs(model: nn.Module, inputs: dict[str, torch.Tensor], *, grad: bool = False) -> torch.Tensor:
    """The model's output as one tensor: logits (Llama), hidden states and pooled output (BERT), the MLP's output."""
    with torch.set_grad_enabled(grad):
        out = model(**inputs)
    if isinstance(out, torch.Tensor):
        return out
    if getattr(out, "logits", None) is not None:
        return out.logits
    pooled = getattr(out, "pooler_output", None)
    parts = [out.last_hidden_state.flatten(1)] + ([pooled.flatten(1)] if pooled is not None else [])
    return torch.cat(parts, dim=1)


def train_step(model: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    """One AdamW step on the mean squared output (trainable parameters only)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    outputs(model, inputs, grad=True).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def trainable(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def no_peft_modules_left(model: nn.Module) -> bool:
    return not any(isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper)) for m in model.modules())


def refuses_in_one_line(pattern: str, call: Callable[[], Any], error: type[Exception] = ValueError) -> str:
    """`call()` raises `error` whose message is one line matching `pattern`; returns the message."""
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    assert re.search(pattern, message), message
    return message


def reload_outputs(jobs: list[tuple[str, bool, str, list[tuple[str, str, dict]]]]) -> list[list[torch.Tensor]]:
    """Run in a fresh process (`fresh_process_outputs`): per job, the family's base model + each saved adapter
    (`PeftModel.from_pretrained` for the first, `load_adapter` for the others), the adapter's outputs on its inputs."""
    from peft import PeftModel

    results = []
    for family, tied, folder, adapters in jobs:
        model, outs = None, []
        for name, path, inputs in adapters:
            path = os.path.join(folder, path)
            if model is None:
                model = PeftModel.from_pretrained(make_model(family, tied), path, adapter_name=name)
            else:
                model.load_adapter(path, adapter_name=name)
            model.set_adapter(name)
            outs.append(outputs(model.eval(), inputs))
        results.append(outs)
    return results


def fresh_process_outputs(jobs: list) -> list[list[torch.Tensor]]:
    """`reload_outputs` for all jobs in another process, freshly imported and holding nothing of this one: a child of
    the warm interpreter (tests/warm.py; starting and importing a new one costs seconds)."""
    return warm.call(reload_outputs, jobs, timeout=300)


@functools.cache
def unload_keeps_trained_copies() -> bool:
    """What the installed peft's `unload()` leaves where a `modules_to_save` wrapper was, asked of LoRA itself: the
    active adapter's trained copy (peft 0.21) or the original module (peft 0.22: only `merge_and_unload()` keeps the
    copy). The battery holds every method to LoRA's answer."""
    from peft import LoraConfig, get_peft_model

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    base = Two()
    original = base.b
    model = get_peft_model(base, LoraConfig(target_modules=["a"], modules_to_save=["b"]))
    return model.unload().b is not original
