"""hf_llmkit.cli.parser: grouped help, JSON flag files, one-line errors, flags of a switched-off feature."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.cli import FlagGroup, UsageError
from hf_llmkit.cli.help import HelpLayout
from hf_llmkit.cli.parser import CommandLineParser


@dataclass
class FeatureArguments:
    help_group: ClassVar[str] = "feature"
    flag_groups: ClassVar[tuple[FlagGroup, ...]] = (
        FlagGroup("--feature on", ("feature_size", "feature_names"), lambda v: v["feature"] == "on"),
    )

    feature: str = field(default="off", metadata={"help": "Switch.", "choices": ["on", "off"]})
    feature_size: int = field(default=3, metadata={"help": "Size (default: three)."})
    feature_names: list[str] | None = field(default=None, metadata={"help": "Names.", "aliases": ["--names"]})
    feature_flag: bool = field(default=True, metadata={"help": "A boolean."})

    def __post_init__(self):
        if self.feature_size < 1:
            raise ValueError(f"--feature_size {self.feature_size} must be at least 1")


def make_parser() -> CommandLineParser:
    layout = HelpLayout(order=("feature", "training"), training_title="training", training_flags=("max_steps",))
    parser = CommandLineParser([FeatureArguments, LLMKitTrainingArguments], layout=layout, prog="cmd.py")
    parser.set_defaults(output_dir="out", report_to="none")
    return parser


def test_help_is_grouped_with_one_spelling_and_one_default_each():
    text = make_parser().format_help()
    titles = re.findall(r"^(\S[^:\n]*):$", text, flags=re.M)
    assert titles[:2] == ["feature", "training"] and "fault tolerance" in titles and "sequence parallel" in titles
    assert "--feature-size" not in text and "--no_feature_flag" not in text  # one spelling each
    assert "--feature_flag {true,false}" in text and "(also --names)" in text
    assert text.count("(default:") == len(re.findall(r"\(default: ", text))
    size_line = next(line for line in text.splitlines() if "--feature_size" in line)
    assert size_line.count("default") == 1  # the help names its default: none appended
    assert "--learning_rate" not in text and "--help-all lists all of them" in text
    full = make_parser().format_help(full=True)
    assert "--learning_rate" in full and "every other TrainingArguments flag:" in full
    assert len(text.splitlines()) < len(full.splitlines()) / 2


def test_typed_flags_are_reported_and_feature_flags_need_their_feature():
    parser = make_parser()
    (feature, training), given = parser.parse(["--feature", "on", "--feature_size", "5", "--no_feature_flag"])
    assert feature.feature_size == 5 and feature.feature_flag is False and training.output_dir == "out"
    assert given == {"feature", "feature_size", "feature_flag"}
    with pytest.raises(
        UsageError, match=r"--feature_size has no effect without --feature on; add --feature on or drop"
    ):
        parser.parse(["--feature_size", "3"])  # typed, even at its default value
    (feature, _), _ = parser.parse(["--feature", "on", "--names", "a,b", "c"])
    assert feature.feature_names == ["a,b", "c"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--feature_sise", "4"], "unknown option --feature_sise; did you mean --feature_size?"),
        (["--zzz"], "unknown option --zzz; --help lists the options"),
        (["stray"], "unexpected argument 'stray'"),
        (["--feature", "maybe"], "--feature: invalid choice: 'maybe'"),
        (["--feature_size", "x"], "--feature_size: invalid int value: 'x'"),
        (["--feature", "on", "--feature_size", "0"], "--feature_size 0 must be at least 1"),
        (["--max_steps"], "--max_steps: expected one argument"),
        (["--feature_s", "4"], "unknown option --feature_s"),  # no silent abbreviations
    ],
)
def test_bad_flags_are_one_line_usage_errors(argv, expected):
    with pytest.raises(UsageError) as info:
        make_parser().parse(argv)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_json_file_is_the_flags(tmp_path):
    flags = tmp_path / "args.json"
    flags.write_text(json.dumps({"feature": "on", "feature_size": 7, "feature_flag": False, "max_steps": 3}))
    (feature, training), given = make_parser().parse([str(flags), "--max_steps", "4"])  # later flags override
    assert (feature.feature_size, feature.feature_flag, training.max_steps) == (7, False, 4)
    assert {"feature", "feature_size", "max_steps"} <= given
    for content, expected in [("[1, 2]", "holds a JSON list"), ("{oops", "is not a JSON file of flags")]:
        flags.write_text(content)
        with pytest.raises(UsageError, match=expected):
            make_parser().parse([str(flags)])
    flags.write_text(json.dumps({"feature_sise": 1}))
    with pytest.raises(UsageError, match="did you mean --feature_size"):
        make_parser().parse([str(flags)])
    with pytest.raises(UsageError, match="missing.json does not exist"):
        make_parser().parse([str(tmp_path / "missing.json")])


def test_derived_defaults_apply_only_to_flags_not_typed():
    def derive(values, given):
        return {"output_dir": f"out-{values['feature']}"}

    (_, training), _ = make_parser().parse(["--feature", "on"], derived_defaults=derive)
    assert training.output_dir == "out-on"
    (_, training), _ = make_parser().parse(["--feature", "on", "--output_dir", "mine"], derived_defaults=derive)
    assert training.output_dir == "mine"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_steps", "2", "--max_steps", "3"], "--max_steps given 2 times, the last one (3) is used"),
        (["--max_steps=2", "--max-steps", "3"], "--max_steps and --max-steps given 2 times, the last one (3) is used"),
        (["--names", "a", "--feature_names", "b", "--feature", "on"], "--names and --feature_names given 2 times"),
        (
            ["--feature_flag", "--no_feature_flag"],
            "--feature_flag and --no_feature_flag given 2 times, the last",
        ),
    ],
)
def test_a_flag_given_twice_says_in_one_line_that_the_last_one_wins(argv, message, caplog):
    """Issue 33: the last of two values silently winning once wrote a run into another run's folder."""
    with caplog.at_level("WARNING", logger="hf_llmkit.cli.parser"):
        make_parser().parse(argv)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and message in lines[0] and "\n" not in lines[0], lines


def test_flags_after_a_json_file_override_it_without_a_warning(tmp_path, caplog):
    flags = tmp_path / "args.json"
    flags.write_text(json.dumps({"max_steps": 10, "feature": "on"}))
    with caplog.at_level("WARNING", logger="hf_llmkit.cli.parser"):
        (feature, training), _ = make_parser().parse([str(flags), "--max_steps", "3"])
        assert training.max_steps == 3 and feature.feature == "on" and not caplog.records
        (_, training), _ = make_parser().parse([str(flags), "--max_steps", "3", "--max_steps", "4"])
    assert training.max_steps == 4 and "--max_steps given 2 times, the last one (4) is used" in caplog.text


def test_a_key_given_twice_in_a_json_file_says_in_one_line_that_the_last_one_wins(tmp_path, caplog):
    """Issue 46: a duplicate key kept its last value silently, where the same flag typed twice warns."""
    flags = tmp_path / "args.json"
    flags.write_text('{"max_steps": 10, "feature": "on", "max_steps": 20}')
    with caplog.at_level("WARNING", logger="hf_llmkit.cli.parser"):
        (*_, training), _ = make_parser().parse([str(flags)])
    assert training.max_steps == 20
    [line] = [record.getMessage() for record in caplog.records]
    assert line == f"max_steps given 2 times in {flags}, the last one (20) is used"
