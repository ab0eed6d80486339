"""JSON and JSON lines read as the JSON standard says, with the line of each value kept for error messages.

A `.json` array is parsed element by element by Python's JSON decoder: a missing `]`, a missing comma between
elements, a trailing comma or anything but whitespace after the `]` raises `ValueError` naming the line and column.
JSON lines split on `"\\n"` only (a `"\\r"` before it is tolerated): U+2028, U+0085 and the other characters
`str.splitlines` treats as line ends are data inside a JSON string, as `json.loads` reads them.

    for line, value in json_array_values(text, where="data.json"): ...   # (line number, element)
    for line, text in json_lines(text): ...                                # (line number, line without its end)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

__all__ = ["JSON_WHITESPACE", "json_array_values", "json_lines", "line_content"]

JSON_WHITESPACE = " \t\r\n"  # the only whitespace the JSON standard allows between values


def _place(text: str, position: int) -> str:
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    return f"line {line} column {column}"


def _skip(text: str, position: int) -> int:
    while position < len(text) and text[position] in JSON_WHITESPACE:
        position += 1
    return position


def json_array_values(text: str, *, where: str, fix: str = "fix the file") -> Iterator[tuple[int, Any]]:
    """(line number, value) of each element of the JSON array `text` (which starts with `[` after whitespace);
    `ValueError` naming `where`, the line and the column at the first place that is not valid JSON."""
    decoder = json.JSONDecoder()

    def refuse(position: int, what: str) -> ValueError:
        return ValueError(f"{where} {_place(text, position)} is not valid JSON ({what}); {fix}")

    position = _skip(text, 0) + 1  # past the "["
    position = _skip(text, position)
    if position < len(text) and text[position] == "]":
        end = _skip(text, position + 1)
        if end < len(text):
            raise refuse(end, "text after the closing ']'")
        return
    while True:
        if position >= len(text):
            raise refuse(position, "the array has no closing ']'")
        try:
            value, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as err:
            raise refuse(err.pos, err.msg) from None
        yield text.count("\n", 0, position) + 1, value
        position = _skip(text, end)
        if position >= len(text):
            raise refuse(position, "the array has no closing ']'")
        if text[position] == "]":
            end = _skip(text, position + 1)
            if end < len(text):
                raise refuse(end, "text after the closing ']'")
            return
        if text[position] != ",":
            raise refuse(position, "expecting ',' or ']' after an element")
        position = _skip(text, position + 1)
        if position < len(text) and text[position] == "]":
            raise refuse(position, "a ',' before the closing ']'")


def line_content(line: str) -> str:
    """A JSON line without its end: the `"\\n"`, and a `"\\r"` before it."""
    line = line[:-1] if line.endswith("\n") else line
    return line[:-1] if line.endswith("\r") else line


def json_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line without its end) of a JSON lines text, split on `"\\n"` only."""
    for number, line in enumerate(text.split("\n"), start=1):
        yield number, line_content(line)
