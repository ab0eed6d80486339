"""The user's text data: find the files and read their rows, rejecting bad files before any work starts.

`.txt` files give one row per non-blank line (`rows="paragraph"`: one per paragraph, the lines between blank lines
joined by their line breaks); `.json` / `.jsonl` files hold JSON lines (split on "\\n" only) or one
JSON array (read strictly, `hf_llmkit.data.json_text`), each row an object with a string `text` field. A file that is
empty, not UTF-8 (binary, reported by line number), malformed, or has a row without a string `text` raises
`ValueError` naming the file, the line and the fix; a `--dataset_dir` is walked without recursion or symlinked
folders, to a bounded depth.

Files are read as a stream, in chunks: memory does not grow with a file. A row longer than `PIECE_CHARS`
characters (a book on one line) comes in pieces cut before a space, so a tokenizer never holds more than a piece.
A JSON line, and a `.json` array file, is parsed whole: larger than `MAX_JSON_BYTES` it is refused before any
work, naming the fix.

    files = find_data_files(dataset_dir="data/")       # sorted .txt / .json / .jsonl files
    source = TextFiles(files)                           # every file checked now, streamed once
    TextFiles(files, rows="paragraph")                  # .txt rows are paragraphs (wrapped prose)
    for piece, ends_row in source.pieces(): ...         # streamed again when read
    texts = read_text_rows(files)                       # list[str] (small files)
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from hf_llmkit.checkpoints.names import path_too_long, shown_path
from hf_llmkit.data.json_text import json_array_values, line_content

__all__ = [
    "MAX_FOLDER_DEPTH",
    "TXT_ROWS",
    "MAX_JSON_BYTES",
    "PIECE_CHARS",
    "TEXT_SUFFIXES",
    "TextFiles",
    "find_data_files",
    "read_file_rows",
    "read_text_rows",
    "split_long_text",
]

TEXT_SUFFIXES = (".txt", ".json", ".jsonl")
TXT_ROWS = ("line", "paragraph")  # what a row of a .txt file is
MAX_FOLDER_DEPTH = 32
PIECE_CHARS = 1 << 16  # a longer row is handed out in pieces of at most this many characters
MAX_JSON_BYTES = 128 << 20  # a JSON line, or a .json array file, is parsed whole
_CHUNK = 4 << 20
_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines splits on


def find_data_files(
    *, dataset_dir: str | None = None, train_file: str | None = None, flag: str | None = None
) -> list[Path]:
    """The text/JSON files to read (empty list without either argument); raises `ValueError` naming the fix."""
    for given, name in ((train_file, flag or "--train_file"), (dataset_dir, flag or "--dataset_dir")):
        too_long = path_too_long(given) if given is not None else None
        if too_long:
            raise ValueError(f"{name} {shown_path(given)} {too_long}; pass a shorter path")
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


def split_long_text(text: str, limit: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of at most `limit` characters, each cut before a space where its second half has one
    (byte-level BPE tokenizers then give the tokens of the whole text)."""
    while len(text) > limit:
        cut = text.rfind(" ", limit // 2, limit)
        cut = limit if cut <= 0 else cut
        yield text[:cut]
        text = text[cut:]
    if text:
        yield text


def _not_utf8(path: Path, data: bytes, start: int, line: int, offset: int) -> ValueError:
    return ValueError(
        f"{path} line {line} is not UTF-8 text (byte 0x{data[start]:02x} at offset {offset}: a binary file?); "
        "convert it to UTF-8 or remove it"
    )


def _split(text: str, newline_only: bool) -> list[str]:
    """`text` in lines that keep their ends: on "\\n" only (JSON lines), or where `str.splitlines` splits (.txt)."""
    if not newline_only:
        return text.splitlines(keepends=True)
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def _lines(path: Path, *, newline_only: bool = False) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, whether the line ends with it) of a UTF-8 file read in chunks; a line longer than
    `PIECE_CHARS` comes in several pieces. `ValueError` at the first line that is not UTF-8 or holds a NUL. Lines
    end where `str.splitlines` splits, or with `newline_only` (JSON lines) at "\\n" only."""
    ends = "\n" if newline_only else _BREAKS
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    number, carry, read = 1, "", 0
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(_CHUNK)
            pending = decoder.getstate()[0]
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                data = pending + chunk
                line = number + carry.count("\n") + data[: err.start].count(b"\n")
                raise _not_utf8(path, data, err.start, line, read - len(pending) + err.start) from None
            read += len(chunk)
            if "\x00" in text:
                line = number + (carry + text[: text.index("\x00")]).count("\n")
                raise ValueError(f"{path} line {line} holds a NUL byte: a binary file; remove it")
            lines = _split(carry + text, newline_only)
            carry = ""
            if lines and chunk and (lines[-1][-1] not in ends or lines[-1][-1] == "\r"):
                carry = lines.pop()  # unfinished (or a "\r" whose "\n" may come with the next chunk)
            for line in lines:
                content = line_content(line) if newline_only else _content(line)
                pieces = list(split_long_text(content)) or [""]
                for index, piece in enumerate(pieces):
                    yield number, piece, index == len(pieces) - 1
                number += 1
            while len(carry) > PIECE_CHARS:
                piece = next(split_long_text(carry))
                yield number, piece, False
                carry = carry[len(piece) :]
            if not chunk:
                return


def _content(line: str) -> str:
    """A line without its line break."""
    return (line.splitlines() or [""])[0]


def _txt_pieces(path: Path) -> Iterator[tuple[str, bool]]:
    open_row = False
    for _, text, ends in _lines(path):
        if open_row or not ends or text.strip():
            yield text, ends
            open_row = not ends


def _paragraph_pieces(path: Path) -> Iterator[tuple[str, bool]]:
    """A row per paragraph: the non-blank lines between blank lines, each after the first led by a line break."""
    pending: str | None = None  # the open paragraph's last piece, handed out once it is known whether it ends it
    after_break = mid_line = False
    for _, text, ends in _lines(path):
        if not mid_line and ends and not text.strip():  # a blank line
            if pending is not None:
                yield pending, True
            pending, after_break = None, False
            continue
        if pending is not None:
            yield pending, False
        pending = ("\n" if after_break and not mid_line else "") + text
        after_break, mid_line = ends, not ends
    if pending is not None:
        yield pending, True


def _json_line(path: Path, number: int, line: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} line {number} is not valid JSON ({err.msg} at column {err.colno}); write one JSON object per line"
        ) from None


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    parts: list[str] = []
    size = 0
    for number, text, ends in _lines(path, newline_only=True):
        parts.append(text)
        size += len(text)
        if size > MAX_JSON_BYTES:
            raise ValueError(
                f"{path} line {number} is over {MAX_JSON_BYTES >> 20} MB, and a JSON line is parsed whole; split "
                "its text over several records, or put the text in a .txt file"
            )
        if ends:
            line, parts, size = "".join(parts), [], 0
            if line.strip():
                yield f"line {number}", _json_line(path, number, line)


def _json_array_rows(path: Path) -> Iterator[tuple[str, object]]:
    if path.stat().st_size > MAX_JSON_BYTES:
        raise ValueError(
            f"{path} is over {MAX_JSON_BYTES >> 20} MB, and a .json array is parsed whole; write one JSON object per "
            "line (.jsonl) instead"
        )
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise _not_utf8(path, data, err.start, data[: err.start].count(b"\n") + 1, err.start) from None
    rows = json_array_values(text, where=str(path))
    return ((f"row {index}", row) for index, (_, row) in enumerate(rows, start=1))


def _is_json_array(path: Path) -> bool:
    if path.suffix != ".json":
        return False
    with open(path, "rb") as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


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


def _file_pieces(path: Path, rows: str = "line") -> Iterator[tuple[str, bool]]:
    """(text, whether the row ends with it) for every row of `path`; checks the file as it goes."""
    found = False
    if path.suffix == ".txt":
        for piece in _paragraph_pieces(path) if rows == "paragraph" else _txt_pieces(path):
            found = True
            yield piece
        if not found:
            raise ValueError(f"{path} is empty; add text or remove the file")
        return
    array = _is_json_array(path)
    seen = array  # a file holding "[]" is not empty, but has no row
    for place, row in _json_array_rows(path) if array else _jsonl_rows(path):
        seen = True
        text = _row_text(path, place, row)
        if text.strip():
            found = True
            pieces = list(split_long_text(text))
            for index, piece in enumerate(pieces):
                yield piece, index == len(pieces) - 1
    if not seen:
        raise ValueError(f"{path} is empty; add text or remove the file")
    if not found:
        raise ValueError(f'{path} has no row with text; add rows like {{"text": "..."}}')


class TextFiles:
    """The rows of text files: every file is checked (streamed once) when this is made, and streamed again when
    read, so memory does not grow with the files. `ValueError` names the file, the line and the fix."""

    def __init__(self, files: Iterable[str | os.PathLike], *, rows: str = "line"):
        if rows not in TXT_ROWS:
            raise ValueError(f"rows={rows!r}: a .txt row is one of {TXT_ROWS}")
        self.files, self.rows = [Path(path) for path in files], rows
        for path in self.files:
            for _ in _file_pieces(path, rows):
                pass

    def pieces(self) -> Iterator[tuple[str, bool]]:
        """(text, whether its row ends with it) of every row of every file, in order."""
        for path in self.files:
            yield from _file_pieces(path, self.rows)

    def __iter__(self) -> Iterator[str]:
        """Whole rows (a row longer than `PIECE_CHARS` is joined again: for small files)."""
        parts: list[str] = []
        for text, ends in self.pieces():
            parts.append(text)
            if ends:
                yield "".join(parts)
                parts = []


def read_file_rows(path: str | os.PathLike) -> list[str]:
    """The non-empty text rows of one `.txt` / `.json` / `.jsonl` file, after checking the whole file."""
    return list(TextFiles([path]))


def read_text_rows(files: Iterable[str | os.PathLike]) -> list[str]:
    """The rows of every file in order (each file checked first)."""
    return list(TextFiles(files))
