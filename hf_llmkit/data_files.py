"""The user's text data: find the files and read their rows, rejecting bad files before any work starts.

`.txt` files give one row per non-blank line; `.json` / `.jsonl` files hold JSON lines or one JSON array, each
row an object with a string `text` field. A file that is empty, not UTF-8 (binary), malformed, or has a row
without a string `text` raises `ValueError` naming the file, the line and the fix; a `--dataset_dir` is walked
without recursion or symlinked folders, to a bounded depth.

    files = find_data_files(dataset_dir="data/")       # sorted .txt / .json / .jsonl files
    texts = read_text_rows(files)                       # list[str], every file checked
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["MAX_FOLDER_DEPTH", "TEXT_SUFFIXES", "find_data_files", "read_file_rows", "read_text_rows"]

TEXT_SUFFIXES = (".txt", ".json", ".jsonl")
MAX_FOLDER_DEPTH = 32


def find_data_files(
    *, dataset_dir: str | None = None, train_file: str | None = None, flag: str | None = None
) -> list[Path]:
    """The text/JSON files to read (empty list without either argument); raises `ValueError` naming the fix."""
    if train_file is not None:
        return [_check_file_name(Path(train_file), flag or "--train_file")]
    if dataset_dir is None:
        return []
    flag = flag or "--dataset_dir"
    folder = Path(dataset_dir)
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise ValueError(f"{flag} {dataset_dir} {what}; pass a folder of .txt / .json / .jsonl files")
    files = _walk(folder, flag)
    if not files:
        raise ValueError(f"{flag} {dataset_dir} holds no .txt, .json or .jsonl file; add some or use --train_file")
    return files


def _check_file_name(path: Path, flag: str) -> Path:
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ValueError(f"{flag} {path} {what}; pass an existing .txt, .json or .jsonl file")
    if path.suffix not in TEXT_SUFFIXES:
        raise ValueError(f"{flag} {path}: unsupported suffix {path.suffix!r}; use .txt, .json or .jsonl")
    return path


def _walk(folder: Path, flag: str) -> list[Path]:
    """Data files under `folder`, depth-first without recursion; hidden entries and symlinked folders skipped."""
    found: list[Path] = []
    pending = [(folder, 0)]
    while pending:
        current, depth = pending.pop()
        try:
            entries = sorted(os.scandir(current), key=lambda e: e.name)
        except OSError as err:
            reason = err.strerror or type(err).__name__
            raise ValueError(
                f"{flag} {folder}: cannot list {str(current)[:200]} ({reason}); move the files up"
            ) from None
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir(follow_symlinks=False):
                if depth + 1 > MAX_FOLDER_DEPTH:
                    raise ValueError(
                        f"{flag} {folder} nests folders more than {MAX_FOLDER_DEPTH} levels deep; move the files up"
                    )
                pending.append((Path(entry.path), depth + 1))
            elif entry.name.endswith(TEXT_SUFFIXES) and entry.is_file():
                found.append(Path(entry.path))
    return sorted(found)


def _decode(path: Path) -> str:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}: a binary file?); "
            "convert it to UTF-8 or remove it"
        ) from None
    if "\x00" in text:
        raise ValueError(f"{path} holds NUL bytes at offset {text.index(chr(0))}: a binary file; remove it")
    if not text.strip():
        raise ValueError(f"{path} is empty; add text or remove the file")
    return text


def _json_rows(path: Path, text: str) -> Iterable[tuple[str, object]]:
    """("row N" / "line N", row) of a `.json` array file, or of a JSON lines file (`.jsonl`, or `.json` not
    starting with "[")."""
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {err.lineno} is not valid JSON ({err.msg}); fix the file") from None
        return ((f"row {index + 1}", row) for index, row in enumerate(rows))
    parsed = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            parsed.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path} line {number} is not valid JSON ({err.msg} at column {err.colno}); "
                "write one JSON object per line"
            ) from None
    return parsed


def _row_text(path: Path, place: str, row: object) -> str:
    where = f"{path} {place}"
    if not isinstance(row, dict):
        raise ValueError(f'{where} is a JSON {type(row).__name__}; write objects like {{"text": "..."}}')
    if "text" not in row:
        fields = ", ".join(sorted(row)[:5]) or "none"
        raise ValueError(f"{where} has no 'text' field (fields: {fields}); name the text field 'text'")
    value = row["text"]
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise ValueError(f"{where}: 'text' is {kind}, not a string; make every 'text' a string")
    return value


def read_file_rows(path: str | os.PathLike) -> list[str]:
    """The non-empty text rows of one `.txt` / `.json` / `.jsonl` file, after checking the whole file."""
    path = Path(path)
    text = _decode(path)
    if path.suffix == ".txt":
        rows = [line for line in text.splitlines() if line.strip()]
    else:
        rows = [_row_text(path, place, row) for place, row in _json_rows(path, text)]
        rows = [row for row in rows if row.strip()]
        if not rows:
            raise ValueError(f'{path} has no row with text; add rows like {{"text": "..."}}')
    return rows


def read_text_rows(files: Iterable[str | os.PathLike]) -> list[str]:
    """The rows of every file in order (each file checked by `read_file_rows`)."""
    rows: list[str] = []
    for path in files:
        rows.extend(read_file_rows(path))
    return rows
