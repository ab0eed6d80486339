"""Every peft internal listed in hf_llmkit.compat.peft still exists in the installed peft, with the same parameters."""

from __future__ import annotations

import inspect
import re

import peft
import pytest
from peft import mapping
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import register_peft_method

from hf_llmkit.compat.peft import BASE_TUNER_HOOKS, BASE_TUNER_LAYER_MEMBERS, CHECKED_AGAINST, MAPPING_TABLES
from hf_llmkit.tuners.bitfit import BitFitLayer, BitFitModel
from hf_llmkit.tuners.bottleneck import BottleneckLayer, BottleneckModel
from hf_llmkit.tuners.ptuning import PTuningEmbedding, PTuningModel
from hf_llmkit.tuners.ptuning_v2 import PTuningV2Attention, PTuningV2Model

CHANGED = f"peft {peft.__version__} changed %s (checked against {CHECKED_AGAINST}); update hf_llmkit.compat.peft"
TUNERS = (BottleneckModel, BitFitModel, PTuningModel, PTuningV2Model)
LAYERS = (BottleneckLayer, BitFitLayer, PTuningEmbedding, PTuningV2Attention)


def test_register_peft_method_still_fills_exactly_our_tables():
    written = set(re.findall(r"\b(PEFT_TYPE_TO_\w+)\[\w+\]\s*=", inspect.getsource(register_peft_method)))
    assert written == set(MAPPING_TABLES), CHANGED % f"the tables register_peft_method fills ({sorted(written)})"
    for table in MAPPING_TABLES:
        assert isinstance(getattr(mapping, table, None), dict), CHANGED % f"peft.mapping.{table}"


@pytest.mark.parametrize("hook", sorted(BASE_TUNER_HOOKS))
def test_base_tuner_hook_still_exists_with_its_parameters(hook):
    member = getattr(BaseTuner, hook, None)
    assert callable(member), CHANGED % f"BaseTuner.{hook} (gone)"
    names = tuple(p for p in inspect.signature(member).parameters if p not in ("self", "cls"))
    expected = BASE_TUNER_HOOKS[hook][0]
    assert names[: len(expected)] == expected, CHANGED % f"BaseTuner.{hook}'s parameters to {names}"


def test_base_tuner_layer_members_are_still_read_and_provided():
    assert "self._disable_adapters" in inspect.getsource(BaseTunerLayer.disable_adapters.fget), CHANGED % (
        "BaseTunerLayer.disable_adapters"
    )
    assert "self._active_adapter" in inspect.getsource(BaseTunerLayer.active_adapter.fget), CHANGED % (
        "BaseTunerLayer.active_adapter"
    )
    move = getattr(BaseTunerLayer, "_move_adapter_to_device_of_base_layer", None)
    assert callable(move) and list(inspect.signature(move).parameters)[:2] == ["self", "adapter_name"], CHANGED % (
        "BaseTunerLayer._move_adapter_to_device_of_base_layer"
    )
    assert set(BASE_TUNER_LAYER_MEMBERS) == {
        "_disable_adapters",
        "_active_adapter",
        "_move_adapter_to_device_of_base_layer",
    }


@pytest.mark.parametrize(("ours", "base"), [(t, BaseTuner) for t in TUNERS] + [(c, BaseTunerLayer) for c in LAYERS])
def test_every_private_peft_member_we_override_is_listed(ours, base):
    """A new override of a private peft member must be added to hf_llmkit.compat.peft (and so get checked above)."""
    listed = set(BASE_TUNER_HOOKS) | set(BASE_TUNER_LAYER_MEMBERS)
    overridden = {
        name
        for klass in ours.__mro__
        if klass.__module__.startswith("hf_llmkit.")
        for name in vars(klass)
        if name.startswith("_") and not name.startswith("__") and name != "_abc_impl" and hasattr(base, name)
    }
    assert overridden <= listed, f"{ours.__name__} overrides private peft members not in compat/peft.py: " + str(
        sorted(overridden - listed)
    )
