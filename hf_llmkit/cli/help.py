"""`--help` a person can read: the command's options in titled groups, one spelling and one default each.

`HfArgumentParser` puts every field under one heading, lists each flag twice (`--foo_bar, --foo-bar`) and prints
defaults twice when the help text already names one. Here each option appears once, as `--foo_bar VALUE`, with
its default once; the dash spelling and `--no_foo` stay accepted but are not listed. Groups come from the
arguments dataclasses (`help_group = "PEFT"`, or `help_groups = {"title": ("field", ...)}`); of
`TrainingArguments`' ~100 flags, `--help` shows the ones a `HelpLayout` names and `--help-all` shows all.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import re
import shutil
import textwrap
from dataclasses import dataclass
from typing import Any

from transformers import TrainingArguments

__all__ = ["HelpLayout", "format_help"]

ALL_TRAINING_TITLE = "every other TrainingArguments flag"
_TYPE_METAVAR = {int: "INT", float: "FLOAT", str: "TEXT"}


@dataclass(frozen=True)
class HelpLayout:
    """How `--help` is laid out.

    Args:
        order: Group titles in the order they are listed (groups not named here follow, in field order).
        training_flags: The `TrainingArguments` fields `--help` lists (under `training_title`); `--help-all` adds
            the rest under their own heading.
        training_title: Title of that group.
        usage: The usage line (default: `prog [--flag VALUE ...]` and `prog args.json`).
    """

    order: tuple[str, ...] = ()
    training_flags: tuple[str, ...] = ()
    training_title: str = "training (TrainingArguments)"
    usage: str | None = None


def _group_title(dtype: type, name: str, layout: HelpLayout, full: bool) -> str | None:
    for title, names in getattr(dtype, "help_groups", {}).items():
        if name in names:
            return title
    if hasattr(dtype, "help_group"):
        return dtype.help_group
    if issubclass(dtype, TrainingArguments):
        if name in _TRAINING_FIELDS:
            if name in layout.training_flags:
                return layout.training_title
            return ALL_TRAINING_TITLE if full else None
        return "more options"
    return dtype.__name__


_TRAINING_FIELDS = {f.name for f in dataclasses.fields(TrainingArguments)}


def _sections(parser: Any, full: bool) -> dict[str, list[argparse.Action]]:
    titles: dict[str, str | None] = {}
    for dtype in parser.dataclass_types:
        for f in dataclasses.fields(dtype):
            titles.setdefault(f.name, _group_title(dtype, f.name, parser.layout, full))
    sections: dict[str, list[argparse.Action]] = {title: [] for title in parser.layout.order}
    for action in parser.flag_actions:
        if action.help == argparse.SUPPRESS or action.option_strings[0] == f"--no_{action.dest}":
            continue  # hidden, or the `--no_x` twin of a boolean listed as `--x {true,false}`
        title = titles.get(action.dest, "help")
        if title is not None:
            sections.setdefault(title, []).append(action)
    return {title: actions for title, actions in sections.items() if actions}


def _is_bool(action: argparse.Action) -> bool:
    return action.nargs == "?" and action.const is True


def _primary(action: argparse.Action) -> str:
    return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])


def _invocation(action: argparse.Action) -> str:
    name = _primary(action)
    if action.nargs == 0:
        return name
    if _is_bool(action) or getattr(action.type, "__name__", "") == "string_to_bool":
        return f"{name} {{true,false}}"
    if action.choices and not _long_choices(action):
        metavar = "{" + ",".join(str(c) for c in action.choices) + "}"
    elif action.choices:
        metavar = "NAME"
    else:
        metavar = _TYPE_METAVAR.get(action.type, "VALUE")
    return f"{name} {metavar} [...]" if action.nargs in ("+", "*") else f"{name} {metavar}"


_GLUE = "\x00"  # a space the wrapper must not break at: "(default: X)" stays on one line


def _long_choices(action: argparse.Action) -> bool:
    return bool(action.choices) and len(",".join(str(c) for c in action.choices)) > 60


def _default_text(value: Any) -> str | None:
    if value is None or value == argparse.SUPPRESS or value == "" or value == []:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


_LONG_HELP = 200  # characters; a longer help (a config's documentation paragraph) shows its first sentence


def _short(text: str) -> str:
    """Help text for a terminal: HTML tags and markdown link targets dropped, a long paragraph cut to its first
    sentence (the declaration keeps the whole)."""
    text = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", re.sub(r"<[^>]+>", "", text))
    if len(text) > _LONG_HELP:
        first = re.match(r"(.+?[.!?])\s+(?=[A-Z`])", text)
        text = first.group(1) if first else text
    return text


def _help_text(action: argparse.Action) -> str:
    text = _short(" ".join((action.help or "").split()))
    dash = "--" + action.dest.replace("_", "-")
    aliases = [o for o in action.option_strings if o not in (_primary(action), dash) and o.startswith("--")]
    if aliases:
        text += f" (also {', '.join(aliases)})"
    if _long_choices(action):
        text += f" One of: {', '.join(str(c) for c in action.choices)}."
    default = _default_text(action.default)
    if default is not None and "default" not in text.lower() and action.nargs != 0:
        text += f" (default:{_GLUE}{default})"
    return text


def _format_action(action: argparse.Action, width: int, column: int = 34) -> list[str]:
    invocation = f"  {_invocation(action)}"
    text = _help_text(action)
    wrapped = [line.replace(_GLUE, " ") for line in textwrap.wrap(text, width=max(width - column, 30))] or [""]
    if len(invocation) + 2 > column:
        lines = [invocation]
        lines += [" " * column + line for line in wrapped]
        return lines
    lines = [invocation.ljust(column) + wrapped[0]]
    lines += [" " * column + line for line in wrapped[1:]]
    return lines


def format_help(parser: Any, *, full: bool = False) -> str:
    """The grouped help of a `CommandLineParser` (`full`: with every TrainingArguments flag)."""
    width = min(shutil.get_terminal_size((110, 24)).columns, 120)
    prog = parser.prog
    usage = parser.layout.usage or f"{prog} [--flag VALUE ...]   or   {prog} args.json [--flag VALUE ...]"
    out = [f"usage: {usage}", ""]
    if parser.description:
        out += [parser.description.strip(), ""]
    for title, actions in _sections(parser, full).items():
        out.append(f"{title}:")
        for action in actions:
            out += _format_action(action, width)
        out.append("")
    if not full:
        hidden = sum(1 for f in _TRAINING_FIELDS if f not in parser.layout.training_flags)
        out.append(
            f"Every transformers TrainingArguments flag works too: --help-all lists all of them ({hidden} more)."
        )
    return "\n".join(out).rstrip() + "\n"
