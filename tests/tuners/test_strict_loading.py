"""hf_llmkit's PEFT methods load strictly: an adapter that does not fit the base model, or whose peft_type was
edited to another of our methods, fails with the keys named instead of loading a different model (issue 11, 5)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel, get_peft_model

import hf_llmkit
from hf_llmkit.testing import tiny_llama

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64)
CONFIGS = {
    "bottleneck": lambda: hf_llmkit.BottleneckConfig(target_modules=["mlp"], init_weights=False),
    "bitfit": lambda: hf_llmkit.BitFitConfig(target_modules=["q_proj", "v_proj"], add_missing_biases=True),
    "ptuning_v2": lambda: hf_llmkit.PTuningV2Config(num_virtual_tokens=3),
}


def _saved(tmp_path, method: str, layers: int = 2):
    model = get_peft_model(tiny_llama(num_hidden_layers=layers, **SMALL), CONFIGS[method]())
    folder = tmp_path / method
    model.save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_the_matching_base_loads_the_same_model(tmp_path, method):
    model, folder = _saved(tmp_path, method)
    reloaded = PeftModel.from_pretrained(tiny_llama(num_hidden_layers=2, **SMALL), folder)
    ids = torch.tensor([[3, 9, 27, 5]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


@pytest.mark.parametrize("method", ["bottleneck", "bitfit"])
@pytest.mark.parametrize(("layers", "problem"), [(1, "unexpected"), (3, "missing")], ids=["shallower", "deeper"])
def test_an_adapter_of_another_depth_fails_naming_the_keys(tmp_path, method, layers, problem):
    _, folder = _saved(tmp_path, method)
    with pytest.raises(ValueError, match=rf"do not fit this {method.upper()} model: {problem} \d+ key\(s\)") as error:
        PeftModel.from_pretrained(tiny_llama(num_hidden_layers=layers, **SMALL), folder)
    layer = "layers.1." if layers == 1 else "layers.2."
    assert layer in str(error.value) and "base model it was trained on" in str(error.value)


@pytest.mark.parametrize(("saved", "edited"), [("bitfit", "BOTTLENECK"), ("ptuning_v2", "BOTTLENECK")])
def test_an_edited_peft_type_fails(tmp_path, saved, edited):
    _, folder = _saved(tmp_path, saved)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["peft_type"] = edited
    config["target_modules"] = ["mlp"]  # valid for the edited method: only the weights give it away
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unexpected .* key") as error:
        PeftModel.from_pretrained(tiny_llama(num_hidden_layers=2, **SMALL), folder)
    assert saved + "_" in str(error.value)


def test_weights_without_adapter_keys_still_load_into_the_peft_model():
    model = get_peft_model(tiny_llama(num_hidden_layers=2, **SMALL), CONFIGS["bottleneck"]())
    base_only = {k: v.clone() for k, v in model.state_dict().items() if "bottleneck_" not in k}
    result = model.load_state_dict(base_only, strict=False)  # the adapter is not being loaded: not our business
    assert not result.unexpected_keys and all("bottleneck_" in k for k in result.missing_keys)
