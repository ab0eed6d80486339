"""Registration of hf_llmkit's tuners with peft: their own peft_type enum, idempotency, import order, loaders."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from peft import PeftConfig, PeftModel, get_peft_model
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
from peft.utils import PeftType

import hf_llmkit
from hf_llmkit.testing import tiny_llama
from hf_llmkit.tuners import LLMKitPeftType, register_tuner
from hf_llmkit.tuners.bitfit import BitFitConfig, BitFitModel
from hf_llmkit.tuners.bottleneck import BottleneckConfig, BottleneckModel
from hf_llmkit.tuners.ptuning import PTuningConfig, PTuningModel
from hf_llmkit.tuners.ptuning_v2 import PTuningV2Config, PTuningV2Model
from tests import warm

METHODS = {
    "BOTTLENECK": (BottleneckConfig, BottleneckModel, lambda: BottleneckConfig(bottleneck_size=4, init_weights=False)),
    "BITFIT": (BitFitConfig, BitFitModel, lambda: BitFitConfig(add_missing_biases=True, init_weights=False)),
    "PTUNING": (PTuningConfig, PTuningModel, lambda: PTuningConfig(num_virtual_tokens=2, virtual_token_start_id=500)),
    "PTUNING_V2": (PTuningV2Config, PTuningV2Model, lambda: PTuningV2Config(num_virtual_tokens=2)),
}
IDS = torch.tensor([[500, 501, 7, 8, 9, 10]])  # P-tuning v1's virtual ids 500, 501 lie inside the 512-token vocabulary


@pytest.mark.parametrize("name", list(METHODS))
def test_import_registers_with_peft_without_touching_its_enum(name):
    config_cls, model_cls, _ = METHODS[name]
    member = LLMKitPeftType[name]
    assert PEFT_TYPE_TO_CONFIG_MAPPING[member] is config_cls and PEFT_TYPE_TO_TUNER_MAPPING[member] is model_cls
    assert PEFT_TYPE_TO_PREFIX_MAPPING[member] == model_cls.prefix == f"{name.lower()}_"
    # the string stored in adapter_config.json finds the same entries; peft's own enum is left as peft built it
    assert PEFT_TYPE_TO_CONFIG_MAPPING[name] is config_cls and name not in PeftType.__members__
    assert config_cls().peft_type is member and member == name and member.value == name


@pytest.mark.parametrize("name", list(METHODS))
def test_saved_config_names_the_type_as_a_string_and_loads_back(name, tmp_path):
    config = METHODS[name][2]()
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["peft_type"] == name
    loaded = PeftConfig.from_pretrained(tmp_path)
    assert type(loaded) is type(config) and loaded.peft_type is LLMKitPeftType[name]


def test_register_twice_and_reimport_are_no_ops():
    register_tuner(name="bottleneck", config_cls=BottleneckConfig, model_cls=BottleneckModel)
    importlib.reload(hf_llmkit)
    assert PEFT_TYPE_TO_CONFIG_MAPPING[LLMKitPeftType.BOTTLENECK] is BottleneckConfig


def test_reloaded_module_re_registers_its_new_classes():
    import hf_llmkit.tuners.bitfit.config as config_module

    try:
        reloaded = importlib.reload(config_module).BitFitConfig
        assert reloaded is not BitFitConfig
        register_tuner(name="bitfit", config_cls=reloaded, model_cls=BitFitModel)
        assert PEFT_TYPE_TO_CONFIG_MAPPING[LLMKitPeftType.BITFIT] is reloaded
    finally:
        config_module.BitFitConfig = BitFitConfig  # later imports must see the registered class again
        register_tuner(name="bitfit", config_cls=BitFitConfig, model_cls=BitFitModel)
    assert PEFT_TYPE_TO_CONFIG_MAPPING[LLMKitPeftType.BITFIT] is BitFitConfig


def test_bad_registrations_name_the_fix():
    class Other(BitFitConfig):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_tuner(name="bitfit", config_cls=Other, model_cls=BitFitModel)
    with pytest.raises(ValueError, match="add its upper-case name to LLMKitPeftType"):
        register_tuner(name="my_method", config_cls=Other, model_cls=BitFitModel)
    with pytest.raises(ValueError, match="add its upper-case name to LLMKitPeftType"):
        register_tuner(name="BITFIT", config_cls=Other, model_cls=BitFitModel)


@pytest.mark.parametrize("name", list(METHODS))
def test_transformers_load_adapter_and_delete_adapter(name, tmp_path):
    """transformers' own adapter API reads `peft_type.value`: a plain string peft_type would fail here."""
    peft_model = get_peft_model(tiny_llama(), METHODS[name][2]()).eval()
    with torch.no_grad():
        expected = peft_model(input_ids=IDS).logits
    peft_model.save_pretrained(tmp_path)
    model = tiny_llama()
    model.load_adapter(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, expected, rtol=0, atol=0)
    model.delete_adapter("default")
    assert not hasattr(model, "peft_config")


def reload_and_compare(root: str, names: list[str]) -> str:
    """Each saved adapter reloaded with `PeftModel.from_pretrained`: its config and model classes are ours, its logits
    the saved ones. Runs in a fresh process (a child of tests/warm.py, which imported peft and then hf_llmkit)."""
    inputs = torch.load(f"{root}/inputs.pt")
    for name in names:
        model = PeftModel.from_pretrained(tiny_llama(), f"{root}/{name}").eval()
        config, tuner = type(model.peft_config["default"]).__name__, type(model.base_model).__name__
        assert config == tuner.replace("Model", "Config"), (config, tuner)
        with torch.no_grad():
            assert torch.equal(model(input_ids=inputs).logits, torch.load(f"{root}/{name}.pt")), name
    return "OK"


# peft is imported (and its tables built) before hf_llmkit registers in the warm interpreter whose child reloads here;
# test_peft_workflows.py reloads in a fresh process that imports hf_llmkit first.
def test_save_then_load_in_a_fresh_process_that_imported_peft_first(tmp_path):
    torch.save(IDS, tmp_path / "inputs.pt")
    for name, (_, _, make_config) in METHODS.items():
        model = get_peft_model(tiny_llama(), make_config()).eval()
        with torch.no_grad():
            torch.save(model(input_ids=IDS).logits, tmp_path / f"{name}.pt")
        model.save_pretrained(tmp_path / name)
    assert warm.call(reload_and_compare, str(tmp_path), list(METHODS), timeout=180) == "OK"
