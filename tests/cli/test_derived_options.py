"""One declaration per option: the main job's flags, help and defaults come from the configs and the registry."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import pytest
from peft import IA3Config

from hf_llmkit import DKMConfig, LLMKitTrainingArguments
from hf_llmkit.cli.moe import MoEArguments
from hf_llmkit.cli.options import config_options, docstring_args
from hf_llmkit.cli.peft import RECIPE_DEFAULTS, PeftArguments, peft_arguments
from hf_llmkit.cli.quantization import DKMArguments
from hf_llmkit.parallel import upcycle_to_moe
from hf_llmkit.tuners import PEFT_METHODS, PeftMethod
from tests.composition.matrix import FEATURE_TITLES
from tests.composition.matrix import PEFT_METHODS as MATRIX_METHODS


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def test_every_dkm_config_field_is_a_flag_with_its_default_and_help():
    flags = _fields(DKMArguments)
    for f in dataclasses.fields(DKMConfig):
        if f.name == "quant_method":
            continue
        flag = flags[f.name if f.name.startswith("dkm_") else f"dkm_{f.name}"]
        assert flag.default == f.default and flag.metadata["help"] == " ".join(f.metadata["help"].split())
    assert DKMArguments(quantization="dkm", dkm_bits=4).build_config() == DKMConfig(bits=4)


def test_a_field_added_to_a_config_is_a_flag_without_a_cli_edit():
    @dataclass
    class WithEngine(DKMConfig):
        engine: str = field(default="auto", metadata={"help": "Which engine clusters the weights."})

    (option,) = [o for o in config_options(WithEngine, prefix="dkm_") if o.field == "engine"]
    assert (option.flag, option.default, option.help) == ("dkm_engine", "auto", "Which engine clusters the weights.")


def test_every_registered_peft_method_is_a_choice_with_its_config_defaults():
    choices = _fields(PeftArguments)["peft_method"].metadata["choices"]
    assert choices == ["none", *PEFT_METHODS] and tuple(PEFT_METHODS) == MATRIX_METHODS
    flags = _fields(PeftArguments)
    for method in PEFT_METHODS.values():
        options = PeftArguments.method_options[method.name]
        assert options, method.name
        for option in options:
            declared = _fields(method.config_cls)[option.field].default
            assert flags[option.flag].default == RECIPE_DEFAULTS.get(option.flag, declared), option.flag
        assert FEATURE_TITLES[method.name] == method.display_name  # the composition matrix reads the registry
        config = PeftArguments(peft_method=method.name).build_config()
        assert type(config) is method.config_cls and PeftArguments(peft_method=method.name).describe()


def test_a_registry_line_is_all_a_new_method_needs():
    """peft's IA3 listed in a registry: its flags, feature group, config and results name follow."""
    methods = {**PEFT_METHODS, "ia3": PeftMethod("ia3", IA3Config, "(IA)3", "feedforward {feedforward_modules}")}
    cls = peft_arguments(methods)
    args = cls(peft_method="ia3", target_modules=["k_proj,down_proj"], ia3_feedforward_modules=["down_proj"])
    config = args.build_config()
    assert isinstance(config, IA3Config) and config.target_modules == {"k_proj", "down_proj"}
    assert args.describe().startswith("(IA)3 (feedforward")
    assert any(g.switch == "--peft_method ia3" and "ia3_feedforward_modules" in g.flags for g in cls.flag_groups)
    spelled = cls.flag_spellings(["--peft_method", "ia3", "--feedforward_modules", "x"], known=set())
    assert spelled["--feedforward_modules"] == "--ia3_feedforward_modules"


def test_moe_flags_are_the_parameters_of_upcycle_to_moe():
    documented = docstring_args(upcycle_to_moe)
    flags = _fields(MoEArguments)
    for name in ("num_experts", "top_k", "capacity_factor", "jitter_noise", "shared_expert_intermediate_size"):
        assert flags[f"moe_{name}"].metadata["help"] == documented[name]
    assert flags["moe_top_k"].default == 2 and flags["moe_num_experts"].default == 8  # 8: the command's choice


def test_every_llmkit_training_argument_is_in_a_help_group(run_clm, capsys):
    with pytest.raises(SystemExit):
        run_clm.run(["--help"])
    text = capsys.readouterr().out
    group_of = {}
    for block in re.split(r"\n(?=\S[^\n]*:\n)", text):
        title, _, rest = block.partition(":\n")
        for flag in re.findall(r"^  --(\w+)", rest, flags=re.M):
            group_of[flag] = title
    ours = [f.name for f in dataclasses.fields(LLMKitTrainingArguments) if f.name not in _fields_of_training_args()]
    assert len(ours) >= 15
    missing = [name for name in ours if group_of.get(name) in (None, "more options", "help")]
    assert missing == []


def _fields_of_training_args() -> set[str]:
    from transformers import TrainingArguments

    return set(_fields(TrainingArguments))
