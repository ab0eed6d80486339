"""examples/run_clm.py with --peft_method: trains only the adapter, saves only the adapter, rejects bad input."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from hf_llmkit.cli.peft import PeftArguments

TINY = [
    "--vocab_size", "512", "--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "2",
    "--max_position_embeddings", "64", "--block_size", "32", "--per_device_train_batch_size", "4",
    "--per_device_eval_batch_size", "8", "--max_train_samples", "16", "--max_eval_samples", "8",
    "--logging_steps", "1", "--disable_tqdm", "true", "--warmup_steps", "0", "--max_steps", "2",
]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (
            ["--peft_method", "bottleneck", "--bottleneck_placement", "pfeiffer", "--bottleneck_size", "8"],
            "bottleneck_",
        ),
        (["--peft_method", "bitfit", "--modules_to_save", "lm_head"], "bitfit_"),
        (["--peft_method", "lora", "--lora_rank", "4", "--target_modules", "q_proj", "v_proj"], "lora_"),
    ],
    ids=["bottleneck", "bitfit+modules_to_save", "lora"],
)
def test_peft_method_trains_and_saves_only_the_adapter(run_clm, tmp_path, flags, key):
    results = run_clm.run([*TINY, "--output_dir", str(tmp_path), *flags])
    assert results["global_step"] == 2
    assert 0 < results["trainable_parameters"] < results["parameters"] / 2
    assert not (tmp_path / "model.safetensors").exists()
    state = load_file(tmp_path / "adapter_model.safetensors")
    assert any(key in k for k in state)
    if "--modules_to_save" in flags:
        assert any("lm_head" in k for k in state)


def test_bad_target_modules_is_a_one_line_usage_error(run_clm, tmp_path):
    with pytest.raises(run_clm.UsageError, match="did you mean"):
        run_clm.run(
            [*TINY, "--output_dir", str(tmp_path), "--peft_method", "bottleneck", "--target_modules", "o_porj"]
        )


def test_adapter_reloads_onto_the_saved_base(run_clm, tmp_path):
    """The run's adapter applies to a base model built the same way (what a user does after training)."""
    run_clm.run([*TINY, "--output_dir", str(tmp_path), "--peft_method", "bottleneck"])
    model_args, *_ = run_clm.parse_args([*TINY, "--output_dir", str(tmp_path)])
    torch.manual_seed(0)
    tokenizer = run_clm.load_tokenizer(model_args)
    model = PeftModel.from_pretrained(run_clm.load_model(model_args, tokenizer), tmp_path)
    assert type(model.peft_config["default"]).__name__ == "BottleneckConfig"


def test_arguments_validate():
    with pytest.raises(ValueError, match="--modules_to_save needs a --peft_method"):
        PeftArguments(modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match="either --bottleneck_size or --bottleneck_reduction_factor, not both"):
        PeftArguments(peft_method="bottleneck", bottleneck_size=8, bottleneck_reduction_factor=4)
    assert PeftArguments().build_config() is None
    assert PeftArguments(peft_method="bitfit").build_config().add_missing_biases
