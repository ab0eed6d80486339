"""The main jobs walk a registry of features (`hf_llmkit.cli.features`): a feature added as one module-like object
plus one registry line gets its flags, defaults, combination check, output folder suffix, model stage, callback and
results-table line, with no edit to the job (the recipe in CONTRIBUTING.md, "Add a main-job feature")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest
from transformers import TrainerCallback

from hf_llmkit.cli import features
from hf_llmkit.cli.feature_flags import FlagGroup
from hf_llmkit.cli.features import FEATURES, Feature
from tests.examples.test_run_clm import TINY


# --- the toy feature: what a contributor writes in hf_llmkit/cli/features/<name>.py ---------------------------------
@dataclass
class ToyArguments:
    """Scale the embeddings by a constant before training (a toy feature).

    Args:
        toy: Switch the toy feature on.
        toy_scale: The factor the input embeddings are multiplied by.
    """

    help_group: ClassVar[str] = "toy"
    flag_groups: ClassVar[tuple[FlagGroup, ...]] = (FlagGroup("--toy true", ("toy_scale",), lambda v: v["toy"]),)

    toy: bool = field(default=False, metadata={"help": "Switch the toy feature on."})
    toy_scale: float = field(default=2.0, metadata={"help": "Factor of the input embeddings.", "gt": 0})


class CountSteps(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


class Toy(Feature):
    name = "toy"
    arguments = ToyArguments
    defaults = {"toy_scale": 3.0}  # the job's default, where it differs from the dataclass's
    stage = 25  # after DKM, before the PEFT adapter wraps the model
    row = "toy"
    row_when_off = "off"
    counter = CountSteps()

    def check(self, args):
        if args.toy.toy and args.moe.upcycle_moe:
            raise ValueError("--toy true and --upcycle_moe true do not mix; drop one")

    def folder_suffix(self, values):
        return "toy" if values["toy"] else None

    def model_stage(self, args, state):
        if args.toy.toy:
            state.model.get_input_embeddings().weight.data.mul_(args.toy.toy_scale)
            state.model.toy_scaled = args.toy.toy_scale

    def callbacks(self, args):
        return [self.counter] if args.toy.toy else []

    def describe(self, args):
        return f"scaled by {args.toy.toy_scale:g}" if args.toy.toy else None


@pytest.fixture
def with_toy(monkeypatch):
    """The one registry line: the toy feature after the others."""
    toy = Toy()
    monkeypatch.setattr(features, "FEATURES", (*FEATURES, toy))
    return toy


def test_a_new_feature_is_one_object_and_one_registry_line(run_clm, with_toy, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default output folder is outputs/run_clm-<suffixes> under the working folder
    args = run_clm.parse_args([*TINY, "--toy", "true", "--max_steps", "2"])
    assert args.toy.toy and args.toy.toy_scale == 3.0  # its flag, with the job's default
    assert args.training.output_dir.endswith("run_clm-toy")  # its folder suffix
    results = run_clm.run([*TINY, "--toy", "true", "--max_steps", "2"])
    assert results["global_step"] == 2 and with_toy.counter.steps == 2  # its callback ran at every step
    table = capsys.readouterr().out
    assert "scaled by 3" in table and "toy" in table  # its line in the results table
    assert results["output_dir"].endswith("run_clm-toy")


def test_its_model_stage_runs_in_stage_order(run_clm, with_toy, tmp_path):
    args = run_clm.parse_args([*TINY, "--toy", "true", "--toy_scale", "0.5", "--output_dir", str(tmp_path)])
    built = run_clm.job.build_model(args, run_clm.load_tokenizer(args.model))
    assert built.model.toy_scaled == 0.5


def test_its_checks_and_flag_groups_refuse_bad_input_in_one_line(run_clm, with_toy, tmp_path):
    common = [*TINY, "--output_dir", str(tmp_path)]
    with pytest.raises(run_clm.UsageError, match="--toy true and --upcycle_moe true do not mix; drop one"):
        run_clm.parse_args([*common, "--toy", "true", "--upcycle_moe", "true"])
    with pytest.raises(run_clm.UsageError, match="--toy_scale has no effect without --toy true"):
        run_clm.parse_args([*common, "--toy_scale", "4"])
    with pytest.raises(run_clm.UsageError, match="--toy_scale 0.0 must be > 0"):
        run_clm.parse_args([*common, "--toy", "true", "--toy_scale", "0"])


def test_off_it_changes_nothing(run_clm, with_toy, tmp_path):
    args = run_clm.parse_args([*TINY, "--output_dir", str(tmp_path)])
    assert not args.toy.toy
    from hf_llmkit.cli.results import describe_setup

    assert ("toy", "off") in describe_setup(args)


def test_the_registry_order_is_the_folder_and_table_order():
    """The shipped features, in the order that names output folders and orders the results table."""
    assert [f.name for f in FEATURES] == ["peft", "dkm", "distillation", "kbit", "moe", "sequence_parallel", "run"]
    stages = sorted((f for f in FEATURES if f.stage is not None), key=lambda f: f.stage)
    assert [f.name for f in stages] == ["distillation", "moe", "dkm", "sequence_parallel", "kbit", "peft"]
    values = {"peft_method": "lora", "quantization": None, "distill_from_source": False, "load_in_kbits": 4,
              "upcycle_moe": True,
              "sequence_parallel_size": 2, "overwrite_output_dir": False, "warmup_ratio": None}  # fmt: skip
    assert features.folder_suffixes(values) == ["lora", "4bit", "moe", "sp2"]


def test_each_option_has_one_default_rule():
    """auto_resume: the run feature's one rule (resume unless --overwrite_output_dir true), also what --help shows."""
    from hf_llmkit.cli.job import EMBEDDED_DEFAULTS

    assert "auto_resume" not in EMBEDDED_DEFAULTS
    assert features.default_values()["auto_resume"] is True
    assert (
        features.derived_defaults({"overwrite_output_dir": True, "warmup_ratio": None}, set())["auto_resume"] is False
    )


def test_the_dkm_config_is_built_once_and_quantize_model_called_from_one_place(run_clm, tmp_path):
    """The run's DKMConfig is built when the arguments are (checked before any work) and that same object quantizes
    the model; in the main jobs only the DKM feature's stage calls `quantize_model`."""
    import re
    from pathlib import Path

    import hf_llmkit.cli as cli

    args = run_clm.parse_args([*TINY, "--quantization", "dkm", "--dkm_bits", "2", "--output_dir", str(tmp_path)])
    config = args.dkm.build_config()
    assert config is args.dkm.build_config() and config.bits == 2
    built = run_clm.job.build_model(args, run_clm.load_tokenizer(args.model))
    assert built.model.config.quantization_config is config
    calls = {
        path.relative_to(Path(cli.__file__).parent).as_posix()
        for path in Path(cli.__file__).parent.rglob("*.py")
        if re.search(r"\bquantize_model\(", path.read_text())
    }
    assert calls == {"features/dkm.py"}
