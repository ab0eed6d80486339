"""Registration of hf_llmkit's tuners with peft: PeftType extension, idempotency, import order."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
from peft.utils import PeftType

import hf_llmkit
from hf_llmkit.tuners import extend_peft_type, register_tuner
from hf_llmkit.tuners.bitfit import BitFitConfig, BitFitModel
from hf_llmkit.tuners.bottleneck import BottleneckConfig, BottleneckModel


@pytest.mark.parametrize(
    ("name", "config_cls", "model_cls"),
    [("BOTTLENECK", BottleneckConfig, BottleneckModel), ("BITFIT", BitFitConfig, BitFitModel)],
)
def test_import_registers_with_peft(name, config_cls, model_cls):
    member = PeftType[name]
    assert PeftType(name) is member and getattr(PeftType, name) is member and member in list(PeftType)
    assert PEFT_TYPE_TO_CONFIG_MAPPING[member] is config_cls
    assert PEFT_TYPE_TO_TUNER_MAPPING[member] is model_cls
    assert PEFT_TYPE_TO_PREFIX_MAPPING[member] == model_cls.prefix
    # the string form stored in adapter_config.json maps back to the same config class
    assert PEFT_TYPE_TO_CONFIG_MAPPING[name] is config_cls
    assert config_cls().peft_type is member


def test_extend_peft_type_is_idempotent_and_keeps_existing_members():
    before = list(PeftType)
    assert extend_peft_type("LORA") is PeftType.LORA
    assert extend_peft_type("BOTTLENECK") is PeftType.BOTTLENECK
    assert list(PeftType) == before


def test_register_twice_and_reimport_are_no_ops():
    register_tuner(name="bottleneck", config_cls=BottleneckConfig, model_cls=BottleneckModel)
    importlib.reload(hf_llmkit)
    assert PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.BOTTLENECK] is BottleneckConfig


def test_reloaded_module_re_registers_its_new_classes():
    import hf_llmkit.tuners.bitfit.config as config_module

    try:
        reloaded = importlib.reload(config_module).BitFitConfig
        assert reloaded is not BitFitConfig
        register_tuner(name="bitfit", config_cls=reloaded, model_cls=BitFitModel)
        assert PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.BITFIT] is reloaded
    finally:
        config_module.BitFitConfig = BitFitConfig  # later imports must see the registered class again
        register_tuner(name="bitfit", config_cls=BitFitConfig, model_cls=BitFitModel)
    assert PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.BITFIT] is BitFitConfig


def test_a_different_class_under_a_taken_name_is_refused():
    class Other(BitFitConfig):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_tuner(name="bitfit", config_cls=Other, model_cls=BitFitModel)


_ORDER_SCRIPT = """
import sys
first = sys.argv[1]
if first == "peft":
    import peft
    from peft import get_peft_model
    import hf_llmkit
else:
    import hf_llmkit
    import peft
    from peft import get_peft_model
import torch
from hf_llmkit.testing import tiny_llama
for cfg in (hf_llmkit.BottleneckConfig(bottleneck_size=4), hf_llmkit.BitFitConfig(add_missing_biases=True)):
    model = get_peft_model(tiny_llama(), cfg)
    assert model.peft_config["default"].peft_type == cfg.peft_type
    loaded = peft.PeftConfig.from_peft_type(**cfg.to_dict())
    assert type(loaded) is type(cfg), type(loaded)
print("OK", first)
"""


@pytest.mark.parametrize("first", ["peft", "hf_llmkit"])
def test_import_order_in_a_fresh_process(first):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_ORDER_SCRIPT), first], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"OK {first}" in proc.stdout


def test_peft_type_extension_on_python_312_semantics():
    """On 3.12+ members must also be class attributes; `extend_peft_type` sets both (checked here on this Python)."""
    assert "BOTTLENECK" in PeftType.__dict__
    assert PeftType._member_map_["BOTTLENECK"] is PeftType.__dict__["BOTTLENECK"]
    assert PeftType._value2member_map_["BOTTLENECK"] is PeftType.BOTTLENECK


# Runs `extend_peft_type` from registration.py's source on another interpreter, against a stand-in
# `class PeftType(str, Enum)` (peft itself is not installed there): the enum trick is what differs across versions.
_ENUM_SCRIPT = """
import enum, sys, types
class PeftType(str, enum.Enum):
    LORA = "LORA"
for name in ("peft", "peft.utils"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["peft.utils.peft_types"] = types.SimpleNamespace(PeftType=PeftType)
namespace = {"__name__": "registration"}
exec(compile(open(sys.argv[1]).read(), "registration.py", "exec"), namespace)
member = namespace["extend_peft_type"]("BOTTLENECK")
assert namespace["extend_peft_type"]("BOTTLENECK") is member
assert PeftType.BOTTLENECK is member and PeftType("BOTTLENECK") is member and PeftType["BOTTLENECK"] is member
assert list(PeftType) == [PeftType.LORA, member] and len(PeftType) == 2 and member in PeftType
assert member == "BOTTLENECK" and member.value == "BOTTLENECK" and {member: 1}["BOTTLENECK"] == 1
assert repr(member) == "<PeftType.BOTTLENECK: 'BOTTLENECK'>", repr(member)
print("OK", sys.version_info[:2])
"""


def _other_pythons() -> list[str]:
    """Interpreters to check: `HF_LLMKIT_EXTRA_PYTHONS` (os.pathsep-separated), else python3.10-3.13 that run."""
    explicit = os.environ.get("HF_LLMKIT_EXTRA_PYTHONS")
    names = explicit.split(os.pathsep) if explicit else [f"python3.{minor}" for minor in (10, 12, 13)]
    found = []
    for name in names:
        exe = shutil.which(name)
        if exe and subprocess.run([exe, "-c", "pass"], capture_output=True, timeout=30).returncode == 0:
            found.append(exe)
    return found


@pytest.mark.parametrize("python", [sys.executable, *_other_pythons()])
def test_extend_peft_type_across_python_versions(python):
    source = Path(hf_llmkit.tuners.registration.__file__)
    proc = subprocess.run([python, "-c", _ENUM_SCRIPT, str(source)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("OK")
