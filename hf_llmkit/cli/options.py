"""Command-line options derived from the declarations they configure: one declaration per option.

A config dataclass (peft-style `field(default=..., metadata={"help": ...})`) or a function's keyword parameters
(annotations, defaults and the docstring's `Args:`) say what each option is. `config_options` / `function_options`
turn them into `Option`s named `<prefix><field>`, and `arguments_class` makes those an `HfArgumentParser` dataclass,
so a field added to a config is a flag of every training command, with its help, type and default, and no edit here.

    options = config_options(DKMConfig, prefix="dkm_", skip=("quant_method",))
    DKMFlags = arguments_class("DKMFlags", options, doc="DKM flags.")   # --dkm_bits INT (default: 3) ...
    config = build_from(DKMConfig, options, vars(parsed))               # DKMConfig(bits=..., ...)

The command line carries bool, int, float, str, a `Literal` of strings (a choice) and lists of str / int, each
optionally None; a field of another type (a dict, a nested config) is no option and keeps its declared default.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, Literal, Union

__all__ = ["Option", "arguments_class", "build_from", "config_options", "docstring_args", "function_options"]

_SCALARS = (bool, int, float, str)
# metadata keys of an option that argparse does not take (CommandLineParser strips them before add_argument)
BOUND_KEYS = ("ge", "gt", "le", "lt", "bound_hint")


@dataclass(frozen=True)
class Option:
    """One flag of a training command and where its value goes.

    Args:
        flag: Field name of the flag (`--dkm_bits` -> "dkm_bits").
        field: The config field or function parameter it sets ("bits").
        type: The type the command line parses (`int`, `float | None`, `list[str] | None`, ...).
        default: The default (`dataclasses.MISSING`: none declared; the command must give one).
        help: The declaration's help text.
        choices: Allowed values (from a `Literal` or the declaration's `choices`).
        aliases: Other spellings (`--trainable` for `--target_modules`).
        bounds: Numeric bounds (`{"ge": 1}`), checked before any work (`hf_llmkit.cli.checks`).
    """

    flag: str
    field: str
    type: Any
    default: Any
    help: str
    choices: tuple | None = None
    aliases: tuple[str, ...] = ()
    bounds: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def metadata(self) -> dict[str, Any]:
        data: dict[str, Any] = {"help": self.help, **self.bounds}
        if self.choices:
            data["choices"] = list(self.choices)
        if self.aliases:
            data["aliases"] = list(self.aliases)
        return data

    def with_default(self, value: Any) -> Option:
        return dataclasses.replace(self, default=value)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (Union, types.UnionType) and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else Union[rest]), True  # noqa: UP007 (a runtime Union of the rest)
    return hint, False


def command_line_type(hint: Any) -> tuple[Any, tuple | None] | None:
    """(the type the command line parses, its choices) for a declared type, or None when it has no flag form.

    `Optional[X]` keeps its None; `list[X] | X` (peft's "one or many") reads as `list[X]`; `Literal["a", "b"]` is
    a `str` choice."""
    inner, optional = _unwrap_optional(hint)
    choices = None
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if origin in (Union, types.UnionType):  # list[X] | X -> list[X]
        lists = [a for a in args if typing.get_origin(a) is list]
        if len(lists) == 1 and len(args) == 2 and typing.get_args(lists[0])[0] in args:
            inner, origin, args = lists[0], list, typing.get_args(lists[0])
        else:
            return None
    if origin is Literal:
        if not all(isinstance(a, str) for a in args):
            return None
        inner, choices = str, tuple(args)
    elif origin is list:
        if len(args) != 1 or args[0] not in (str, int):
            return None
        inner = list[args[0]]
    elif inner not in _SCALARS:
        return None
    return (inner | None if optional else inner), choices


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not MISSING:
        return field.default
    if field.default_factory is not MISSING:
        return field.default_factory()
    return MISSING


def config_options(
    cls: type,
    *,
    prefix: str,
    skip: Iterable[str] = (),
    rename: Mapping[str, str] | None = None,
    aliases: Mapping[str, Iterable[str]] | None = None,
) -> list[Option]:
    """The options of a config dataclass: every init field of a command-line type, except `skip`.

    A flag is `prefix + field` (a field already starting with `prefix` keeps its name); `rename` maps a field to
    another name after the prefix (`{"r": "rank"}` -> `--lora_rank`); `aliases` adds spellings by field."""
    hints = typing.get_type_hints(cls)
    rename, aliases, skip = dict(rename or {}), dict(aliases or {}), set(skip)
    options = []
    for field in dataclasses.fields(cls):
        if not field.init or field.name in skip:
            continue
        parsed = command_line_type(hints[field.name])
        if parsed is None:
            continue
        kind, choices = parsed
        name = rename.get(field.name, field.name)
        flag = name if name.startswith(prefix) else prefix + name
        options.append(
            Option(
                flag=flag,
                field=field.name,
                type=kind,
                default=_default_of(field),
                help=" ".join(str(field.metadata.get("help", "")).split()),
                choices=tuple(field.metadata.get("choices", ())) or choices,
                aliases=tuple(f"--{a}" for a in aliases.get(field.name, ())),
                bounds={k: field.metadata[k] for k in BOUND_KEYS if k in field.metadata},
            )
        )
    return options


def docstring_args(func: Callable) -> dict[str, str]:
    """`name: text` entries of a Google-style docstring's `Args:` section, continuation lines joined."""
    doc = inspect.getdoc(func) or ""
    section = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)*)", doc, flags=re.M)
    entries: dict[str, str] = {}
    current = None
    for line in (section.group(1) if section else "").splitlines():
        match = re.match(r"^ {4}(\w+)(?: \([^)]*\))?: ?(.*)$", line)
        if match:
            current = match.group(1)
            entries[current] = match.group(2).strip()
        elif current is not None and line.strip():
            entries[current] += " " + line.strip()
    return entries


def function_options(func: Callable, *, prefix: str, skip: Iterable[str] = ()) -> list[Option]:
    """The options of a function's keyword-only parameters (annotation, default, docstring `Args:` help)."""
    hints = typing.get_type_hints(func)
    helps = docstring_args(func)
    options = []
    for name, parameter in inspect.signature(func).parameters.items():
        if parameter.kind is not inspect.Parameter.KEYWORD_ONLY or name in skip:
            continue
        parsed = command_line_type(hints.get(name, Any))
        if parsed is None:
            continue
        default = MISSING if parameter.default is inspect.Parameter.empty else parameter.default
        flag = name if name.startswith(prefix) else prefix + name
        options.append(Option(flag=flag, field=name, type=parsed[0], default=default, help=helps.get(name, ""),
                              choices=parsed[1]))  # fmt: skip
    return options


def arguments_class(
    name: str, options: Iterable[Option], *, doc: str, module: str, namespace: Mapping[str, Any] | None = None
) -> type:
    """An `HfArgumentParser` dataclass with one field per option (each must have a default by now), defined as
    `module.name` with the methods in `namespace`."""
    fields = []
    for option in options:
        if option.default is MISSING:
            raise TypeError(f"{name}: --{option.flag} has no default; give it one (Option.with_default)")
        default = option.default
        spec = (
            dataclasses.field(default_factory=lambda d=default: list(d), metadata=option.metadata())
            if isinstance(default, list)
            else dataclasses.field(default=default, metadata=option.metadata())
        )
        fields.append((option.flag, option.type, spec))
    cls = dataclasses.make_dataclass(name, fields, namespace=dict(namespace or {}))
    cls.__doc__ = doc
    cls.__module__ = module
    return cls


def build_from(target: Callable, options: Iterable[Option], values: Mapping[str, Any], **fixed: Any) -> Any:
    """`target(**{option.field: values[option.flag]}, **fixed)`: the config (or call) the flags stand for. Its
    `ValueError`s name the flags instead of the fields (`DKMConfig.bits must be ...` -> `--dkm_bits must be ...`)."""
    options = list(options)
    try:
        return target(**{option.field: values[option.flag] for option in options}, **fixed)
    except ValueError as err:
        raise ValueError(flag_names(str(err), target, options)) from err


def flag_names(message: str, target: Callable, options: Iterable[Option]) -> str:
    """`message` with its field names written as the fields' flags: `Target.field`, a leading `field`, and any
    `field_name` with an underscore (a one-word name such as `bits` may be prose elsewhere in the message)."""
    owner = re.escape(getattr(target, "__name__", ""))
    for option in options:
        flag, name = f"--{option.flag}", re.escape(option.field)
        message = re.sub(rf"\b{owner}\.{name}\b", flag, message)
        pattern = rf"(?<![-\w.]){name}\b" if "_" in option.field else rf"^{name}\b"
        message = re.sub(pattern, flag, message)
    return message
