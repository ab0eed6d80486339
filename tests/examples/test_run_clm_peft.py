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


def test_merge_adapter_added_to_a_finished_run_merges_its_final_adapter_without_training(run_clm, tmp_path):
    """Issue 52: adding `--merge_adapter true` to a finished adapter run was refused as a changed run whose every fix
    retrains. It writes nothing a checkpoint holds, so the re-run resumes at the run's end and merges its adapter."""
    from transformers import AutoModelForCausalLM

    flags = [*TINY, "--output_dir", str(tmp_path), "--peft_method", "lora", "--learning_rate", "3e-2"]
    run_clm.run(flags)
    train_results = (tmp_path / "train_results.json").read_text()
    results = run_clm.run([*flags, "--merge_adapter", "true"])
    assert results["resumed_at"] == results["global_step"] == 2  # nothing trained
    assert (tmp_path / "train_results.json").read_text() == train_results
    assert results["merged_model"] == str(tmp_path / "merged")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(ids).logits
    assert not torch.allclose(adapted, plain, atol=1e-3)  # the trained adapter, not a fresh one, was merged
    assert torch.allclose(merged, adapted, atol=1e-5)


def test_merge_of_a_finished_run_without_checkpoints_is_the_merge_command(run_clm, tmp_path, capsys):
    """A finished run that kept no checkpoint (`--save_strategy no`) cannot be resumed at its end: the re-run with
    `--merge_adapter true` is refused in one line naming `python -m hf_llmkit.cli.merge`, which merges without
    training (and says in one line what it cannot merge)."""
    from transformers import AutoModelForCausalLM

    from hf_llmkit.cli import merge

    out = tmp_path / "out"
    flags = [*TINY, "--output_dir", str(out), "--peft_method", "lora", "--learning_rate", "3e-2"]
    run_clm.run([*flags, "--save_strategy", "no", "--do_eval", "false"])
    with pytest.raises(
        run_clm.UsageError, match=f"merge its adapter without training: python -m hf_llmkit.cli.merge {out} "
    ):
        run_clm.run([*flags, "--save_strategy", "no", "--do_eval", "false", "--merge_adapter", "true"])
    capsys.readouterr()  # the runs' tables
    assert merge.main([str(out)]) == 0 and capsys.readouterr().out.strip() == str(out / "merged")
    base = AutoModelForCausalLM.from_pretrained(out / "base")
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, out / "adapter")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged")(ids).logits
    assert torch.allclose(merged, adapted, atol=1e-5)
    assert merge.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"python -m hf_llmkit.cli.merge: error: {tmp_path} holds no adapter (no adapter/adapter_config.json): "
        "pass the --output_dir of a run trained with --peft_method lora or bitfit"
    ]
