"""`CommandLineParser`: `HfArgumentParser` for a training command that people type.

On top of `HfArgumentParser` (one flag per dataclass field):

- `--help` lists the command's own options in titled groups (model, data, PEFT, ...) with one spelling and one
  default each; `--help-all` adds every `TrainingArguments` flag (`hf_llmkit.cli.help`).
- `command.py args.json` reads the flags from a JSON object (`{"max_steps": 10, "peft_method": "lora"}`); flags
  after the file override it.
- Bad input never prints a usage block or a traceback: unknown flags (with a "did you mean"), invalid values,
  NaN, infinite or out-of-bounds numbers (`hf_llmkit.cli.checks`), `__post_init__` checks and flags of a feature
  that is switched off (`hf_llmkit.cli.feature_flags`) all raise `UsageError`, printed as one line by
  `exit_on_error`.
- A dataclass may offer spellings that depend on the command line (`flag_spellings(argv, known) -> {old: new}`, e.g.
  a PEFT method's flags without its prefix), and say what an unknown flag is (`unknown_flag_hint(flag)`).
- A flag typed twice: the last one wins, as in argparse, with one warning line naming it (flags after a JSON
  file of flags override the file's without one).
- `parse()` also returns the flags the user typed, so a command can derive defaults from them (an output folder
  per feature, say) and tell "left at its default" from "set to its default".
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser

from hf_llmkit.cli.checks import check_numbers
from hf_llmkit.cli.errors import UsageError, one_line, usage_errors
from hf_llmkit.cli.feature_flags import FlagGroup, check_feature_flags
from hf_llmkit.cli.help import HelpLayout, format_help
from hf_llmkit.cli.options import BOUND_KEYS

__all__ = ["CommandLineParser", "json_file_to_argv"]

logger = logging.getLogger(__name__)

DerivedDefaults = Callable[[dict[str, Any], set[str]], Mapping[str, Any]]


class _PrintFullHelp(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(parser.format_help(full=True))
        parser.exit()


class CommandLineParser(HfArgumentParser):
    """`HfArgumentParser` with grouped help, JSON files, one-line errors and feature-flag checks.

    Args:
        dataclass_types: The arguments dataclasses, in the order `parse()` returns them. A dataclass titles its
            help group with a `help_group` class attribute, or spreads its fields over several groups with
            `help_groups = {"title": ("field", ...)}`; each may list `flag_groups` (`FlagGroup`s).
        layout: Group order and the `TrainingArguments` flags `--help` shows (`hf_llmkit.cli.help.HelpLayout`).
        flag_groups: More `FlagGroup`s, for flags whose feature is switched on in another dataclass.
        renamed_flags: Old spellings read as new ones (`{"--gradient_checkpointing": "--activation_checkpointing"}`),
            so a recipe written for an older transformers keeps its meaning without a deprecation warning.
        kwargs: Passed to `argparse.ArgumentParser` (`prog`, `description`, ...).
    """

    def __init__(
        self,
        dataclass_types: Iterable[type],
        *,
        layout: HelpLayout | None = None,
        flag_groups: Iterable[FlagGroup] = (),
        renamed_flags: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        self.renamed_flags = dict(renamed_flags or {})
        self.flag_actions: list[argparse.Action] = []  # every action, recorded as it is added (help, flag lookup)
        self.layout = layout or HelpLayout()
        kwargs.setdefault("allow_abbrev", False)  # `--lora_r` must not silently mean `--lora_rank`
        super().__init__(list(dataclass_types), **kwargs)
        self.add_argument("--help-all", action=_PrintFullHelp, help="Show every option, all TrainingArguments too.")
        self.flag_groups = [*flag_groups]
        for dtype in self.dataclass_types:
            self.flag_groups.extend(getattr(dtype, "flag_groups", ()))

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        for key in BOUND_KEYS:  # field metadata that hf_llmkit.cli.checks reads, not argparse
            kwargs.pop(key, None)
        action = super().add_argument(*args, **kwargs)
        self.flag_actions.append(action)
        return action

    def error(self, message: str):  # argparse's errors (bad values, missing values): one line, no usage block
        # "argument --foo_bar/--foo-bar: invalid choice ..." -> "--foo_bar: invalid choice ..." (one spelling)
        raise UsageError(re.sub(r"^argument (--?[\w-]+)(?:/--?[\w-]+)*:", r"\1:", message))

    def format_help(self, full: bool = False) -> str:
        return format_help(self, full=full)

    def parse(
        self,
        argv: Sequence[str] | None = None,
        *,
        derived_defaults: DerivedDefaults | None = None,
        prechecks: Iterable[Callable[[dict[str, Any]], None]] = (),
    ) -> tuple[tuple[Any, ...], set[str]]:
        """Parse `argv` (default: `sys.argv[1:]`) into the dataclasses; also return the flags that were typed.

        `derived_defaults(values, given)` may return new values for flags the user did not type (by field name);
        they apply before the dataclasses are built, so their `__post_init__` checks see them. Each of
        `prechecks(values)` runs before that too and raises `ValueError` for input that a `__post_init__` would
        act on (a `TrainingArguments` with a missing DeepSpeed file leaves global state half set up).
        """
        argv = list(sys.argv[1:] if argv is None else argv)
        from_file = 0
        if argv and argv[0].endswith(".json") and not argv[0].startswith("-"):
            file_argv = json_file_to_argv(argv[0])
            argv, from_file = file_argv + argv[1:], len(file_argv)
        typed, argv = argv, self._respell(argv)
        self._warn_repeats(argv[from_file:], typed[from_file:])  # flags after a JSON file override it
        namespace, rest = self.parse_known_args(argv)
        if rest:
            raise UsageError(self._unknown_message(rest))
        values = vars(namespace)
        given = self.given_flags(argv)
        if derived_defaults is not None:
            values.update({k: v for k, v in derived_defaults(dict(values), given).items() if k not in given})
        with usage_errors():
            check_feature_flags(self.flag_groups, values, given)  # before __post_init__: the flag is the news
            check_numbers(self.dataclass_types, values, {name: self.get_default(name) for name in values})
            for check in prechecks:
                check(values)
            parsed = tuple(self._build(dtype, values) for dtype in self.dataclass_types)
        return parsed, given

    def given_flags(self, argv: Sequence[str]) -> set[str]:
        """Field names of the flags present in `argv` (`--no_x` counts as `x`; aliases map to their field)."""
        by_option = {option: action.dest for action in self.flag_actions for option in action.option_strings}
        given = set()
        for token in argv:
            if token.startswith("--"):
                dest = by_option.get(token.split("=", 1)[0])
                if dest is not None and dest != argparse.SUPPRESS:
                    given.add(dest)
        return given

    def _warn_repeats(self, argv: Sequence[str], typed: Sequence[str]) -> None:
        """A flag typed twice (under any spelling: `argv` respelled, `typed` as typed): the last one wins, as in
        argparse, and one warning line says so (a silent last-wins once wrote a run into another run's folder)."""
        by_option = {option: action for action in self.flag_actions for option in action.option_strings}
        seen: dict[str, list[str]] = {}
        last: dict[str, str] = {}
        for index, (token, as_typed) in enumerate(zip(argv, typed)):
            name, sep, value = token.partition("=")
            action = by_option.get(name) if token.startswith("--") else None
            if action is None or action.dest == argparse.SUPPRESS:
                continue
            seen.setdefault(action.dest, []).append(as_typed.partition("=")[0])
            following = argv[index + 1] if index + 1 < len(argv) else ""
            last[action.dest] = value if sep else following if action.nargs != 0 and following[:2] != "--" else ""
        repeated = [(dest, names) for dest, names in seen.items() if len(names) > 1]
        if repeated and os.environ.get("RANK", "0") == "0":
            said = "; ".join(
                f"{' and '.join(dict.fromkeys(names))} given {len(names)} times, the last one"
                + (f" ({last[dest]})" if last[dest] else "") + " is used"
                for dest, names in repeated
            )  # fmt: skip
            logger.warning("%s", said)

    def _respell(self, argv: list[str]) -> list[str]:
        """Old and command-dependent spellings replaced by the flags they stand for."""
        renamed = dict(self.renamed_flags)
        known = {option for action in self.flag_actions for option in action.option_strings}
        for dtype in self.dataclass_types:
            if hasattr(dtype, "flag_spellings"):
                renamed.update(dtype.flag_spellings(argv, known))
        out = []
        for token in argv:
            name, sep, value = token.partition("=")
            out.append(renamed.get(name, name) + sep + value if token.startswith("--") else token)
        return out

    def _build(self, dtype: type, values: dict[str, Any]) -> Any:
        names = {f.name for f in dataclasses.fields(dtype) if f.init}
        return dtype(**{name: values[name] for name in names if name in values})

    def _unknown_message(self, rest: list[str]) -> str:
        options = [option for action in self.flag_actions for option in action.option_strings]
        token = next((t for t in rest if t.startswith("-")), rest[0])
        if not token.startswith("-"):
            return f"unexpected argument {token!r}; flags start with -- (e.g. --output_dir {token})"
        name = token.split("=", 1)[0]
        for dtype in self.dataclass_types:  # a dataclass may know the flag under another spelling
            hint = dtype.unknown_flag_hint(name) if hasattr(dtype, "unknown_flag_hint") else None
            if hint:
                return hint
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else "; --help lists the options"
        return f"unknown option {name}{hint}"


def _pairs_of(path: str | Path) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """`json.loads`' object hook for a file of flags: a key given twice keeps its last value, as a flag typed twice
    does, and says so in one warning line."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for key, _ in items:
            counts[key] = counts.get(key, 0) + 1
        data = dict(items)
        repeated = [f"{key} given {n} times in {path}, the last one ({data[key]}) is used" for key, n in counts.items()
                    if n > 1]  # fmt: skip
        if repeated and os.environ.get("RANK", "0") == "0":
            logger.warning("%s", "; ".join(repeated))
        return data

    return pairs


def json_file_to_argv(path: str | Path) -> list[str]:
    """The flags a JSON object file stands for: `{"max_steps": 10, "fp16": true}` -> `--max_steps 10 --fp16 true`."""
    file = Path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"), object_pairs_hook=_pairs_of(path))
    except FileNotFoundError:
        raise UsageError(
            f"{path} does not exist; pass an existing JSON file of flags, or the flags themselves"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError, IsADirectoryError) as err:
        raise UsageError(f"{path} is not a JSON file of flags ({one_line(err)}); write one JSON object") from err
    if not isinstance(data, dict):
        raise UsageError(
            f'{path} holds a JSON {type(data).__name__}; write one object of flags, e.g. {{"max_steps": 10}}'
        )
    argv: list[str] = []
    for key, value in data.items():
        if value is None:
            continue  # null: leave the flag at its default
        argv.append(f"--{key}")
        if isinstance(value, bool):
            argv.append("true" if value else "false")
        elif isinstance(value, list):
            argv.extend(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)
        elif isinstance(value, dict):
            argv.append(json.dumps(value))
        else:
            argv.append(str(value))
    return argv
