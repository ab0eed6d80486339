"""Every number of the main job is checked before any work: NaN, infinities, values out of their declared bounds,
and a run that would train nothing end in one line naming the flag (exit status 2 through `main`)."""

from __future__ import annotations

import pytest

from hf_llmkit.cli.checks import check_numbers, describe_bounds

CASES = [
    (["--learning_rate", "nan"], "--learning_rate nan is not a number; pass a finite value (e.g. 0.001)"),
    (["--learning_rate", "-1"], "--learning_rate -1.0 must be > 0"),
    (["--learning_rate", "inf"], "--learning_rate inf is not finite"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps 0 must be at least 1"),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0 must be at least 1"),
    (["--per_device_eval_batch_size", "-2"], "--per_device_eval_batch_size -2 must be at least 1"),
    (["--max_steps", "-1", "--num_train_epochs", "0"], "--num_train_epochs 0.0 trains nothing"),
    (["--num_train_epochs", "0"], "--num_train_epochs 0.0 trains nothing"),
    (["--max_steps", "0"], "--max_steps 0 trains nothing"),
    (["--max_steps", "-5"], "--max_steps -5 must be >= -1 (-1 trains for --num_train_epochs)"),
    (["--warmup_steps", "-3"], "--warmup_steps -3.0 must be >= 0"),
    (["--weight_decay", "nan"], "--weight_decay nan is not a number"),
    (["--save_steps", "0"], "--save_steps 0.0 must be > 0"),
    (["--logging_steps", "-1"], "--logging_steps -1.0 must be > 0"),
    (["--eval_steps", "0"], "--eval_steps 0.0 must be > 0"),
    (["--save_total_limit", "0"], "--save_total_limit 0 must be at least 1 (omit it to keep every checkpoint)"),
    (["--adam_beta2", "1"], "--adam_beta2 1.0 must be in [0, 1)"),
    (["--seed", "-1"], "--seed -1 must be in [0, 4294967295]"),
    (["--block_size", "0"], "--block_size 0 must be at least 2"),
    (["--hidden_size", "0"], "--hidden_size 0 must be at least 1"),
    (["--validation_split_percentage", "nan"], "--validation_split_percentage nan is not a number"),
    (["--save_retry_delay", "inf"], "--save_retry_delay inf is not finite"),
    (["--moe_aux_loss_coef", "nan", "--upcycle_moe", "true"], "--moe_aux_loss_coef nan is not a number"),
    (["--quantization", "dkm", "--dkm_bits", "0"], "--dkm_bits must be an integer from 1 to 8"),
    (["--quantization", "dkm", "--dkm_temperature", "inf"], "--dkm_temperature inf is not finite"),
    (["--peft_method", "lora", "--lora_rank", "0"], "--lora_rank 0 must be at least 1"),
    (["--peft_method", "lora", "--lora_dropout", "1"], "--lora_dropout 1.0 must be in [0, 1)"),
    (["--peft_method", "bottleneck", "--bottleneck_size", "0"], "--bottleneck_size must be >= 1, got 0"),
    (["--peft_method", "ptuning", "--num_virtual_tokens", "0"], "--ptuning_num_virtual_tokens must be an int >= 1"),
    (["--upcycle_moe", "true", "--moe_num_experts", "-1"], "--moe_num_experts -1 must be at least 1"),
    (["--upcycle_moe", "true", "--moe_jitter_noise", "2"], "--moe_jitter_noise 2.0 must be in [0, 1)"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "expected"), CASES, ids=[" ".join(case[0]) for case in CASES])
def test_bad_number_is_one_line_before_any_work(run_clm, tmp_path, flags, expected):
    out = tmp_path / "out"
    with pytest.raises(run_clm.UsageError) as info:
        run_clm.run([*flags, "--output_dir", str(out)])
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not out.exists()


def test_zero_steps_are_fine_when_not_training(run_clm, tmp_path):
    args = run_clm.parse_args(["--do_train", "false", "--max_steps", "0", "--output_dir", str(tmp_path)])
    assert args.training.max_steps == 0


def test_bounds_read_as_a_person_writes_them():
    assert describe_bounds({"gt": 0, "lt": 100}, integer=False) == "between 0 and 100 (exclusive)"
    assert describe_bounds({"ge": 0, "lt": 1}, integer=False) == "in [0, 1)"
    assert describe_bounds({"ge": 1}, integer=True) == "at least 1"
    assert describe_bounds({"ge": -1}, integer=True) == ">= -1"


def test_a_declared_bound_is_checked_in_any_dataclass():
    from dataclasses import dataclass, field

    @dataclass
    class Knobs:
        rate: float = field(default=0.5, metadata={"help": "A rate.", "gt": 0, "le": 1, "bound_hint": "a share"})

    check_numbers([Knobs], {"rate": 1.0})
    with pytest.raises(ValueError, match=r"--rate 1.5 must be in \(0, 1\] \(a share\)"):
        check_numbers([Knobs], {"rate": 1.5})
