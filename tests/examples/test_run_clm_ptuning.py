"""examples/run_clm.py with --peft_method ptuning / ptuning_v2: trains and saves only the adapter, which reloads."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tests.examples.test_run_clm_peft import TINY  # the same tiny model, data and 2 steps


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (["--peft_method", "ptuning", "--num_virtual_tokens", "3", "--ptuning_template", "[P0][P1] {text} [P2]"],
         ".ptuning_encoder."),
        (["--peft_method", "ptuning_v2", "--num_virtual_tokens", "4", "--prefix_projection", "true",
          "--encoder_hidden_size", "16"], ".ptuning_v2_prefix."),
    ],
    ids=["ptuning", "ptuning_v2"],
)  # fmt: skip
def test_ptuning_methods_train_save_and_reload(run_clm, tmp_path, flags, key):
    results = run_clm.run([*TINY, "--output_dir", str(tmp_path), *flags])
    assert results["global_step"] == 2 and 0 < results["trainable_parameters"] < results["parameters"] / 2
    assert not (tmp_path / "model.safetensors").exists()
    state = load_file(tmp_path / "adapter_model.safetensors")
    assert state and all(key in k for k in state)
    model_args, *_ = run_clm.parse_args([*TINY, "--output_dir", str(tmp_path)])
    torch.manual_seed(0)
    base = run_clm.load_model(model_args, run_clm.load_tokenizer(model_args))
    model = PeftModel.from_pretrained(base, tmp_path)
    assert type(model.peft_config["default"]).__name__ == (
        "PTuningConfig" if "ptuning_encoder" in key else "PTuningV2Config"
    )
    if "--ptuning_template" in flags:  # the saved tokenizer holds the virtual tokens at the adapter's ids
        tokenizer = AutoTokenizer.from_pretrained(tmp_path)
        start = model.peft_config["default"].virtual_token_start_id
        assert tokenizer.convert_tokens_to_ids(["[P0]", "[P2]"]) == [start, start + 2]


def test_bad_ptuning_template_is_a_one_line_usage_error(run_clm, tmp_path):
    args = [*TINY, "--output_dir", str(tmp_path), "--peft_method", "ptuning", "--num_virtual_tokens", "3"]
    with pytest.raises(run_clm.UsageError, match=r"does not place the virtual tokens \[P2\]"):
        run_clm.run([*args, "--ptuning_template", "[P0][P1] {text}"])
