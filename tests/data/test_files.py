"""hf_llmkit.data.files: every bad data file is refused with one sentence naming the file, the place (its line
number, also deep in a large file) and the fix; files are streamed, a long row in pieces."""

from __future__ import annotations

import json

import pytest

from hf_llmkit.data.files import (
    MAX_FOLDER_DEPTH,
    PIECE_CHARS,
    TextFiles,
    find_data_files,
    read_file_rows,
    read_text_rows,
)

BAD_FILES = {
    "empty.txt": (b"", "empty.txt is empty"),
    "blank.txt": (b"  \n\n \t\n", "blank.txt is empty"),
    "binary.txt": (b"\x89PNG\r\n\x1a\n\x00\x00\xff", "binary.txt line 1 is not UTF-8 text (byte 0x89 at offset 0"),
    "nul.txt": (b"text\x00more", "nul.txt line 1 holds a NUL byte: a binary file"),
    "latin1.jsonl": ('{"text": "caf\xe9"}\n'.encode("latin-1"), "latin1.jsonl line 1 is not UTF-8 text (byte 0xe9"),
    "malformed.jsonl": (b'{"text": "a"}\n{"text": oops}\n', "malformed.jsonl line 2 is not valid JSON"),
    "truncated.json": (b'[{"text": "a"}, {"text": ', "truncated.json line 1 column 26 is not valid JSON"),
    "notext.jsonl": (
        b'{"title": "x", "body": "y"}\n',
        "notext.jsonl line 1 has no 'text' field (fields: body, title)",
    ),
    "number.jsonl": (b'{"text": "a"}\n{"text": 5}\n', "number.jsonl line 2: 'text' is int, not a string"),
    "null.json": (b'[{"text": "a"}, {"text": null}]', "null.json row 2: 'text' is null, not a string"),
    "list_row.jsonl": (b'["text"]\n', "list_row.jsonl line 1 is a JSON list"),
    "no_rows.json": (b"[]", "no_rows.json has no row with text"),
    "empty_text.jsonl": (b'{"text": ""}\n{"text": " "}\n', "empty_text.jsonl has no row with text"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_file_is_refused_with_its_name_and_place(tmp_path, name):
    content, expected = BAD_FILES[name]
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        read_file_rows(path)
    message = str(info.value)
    assert expected in message and "\n" not in message


def test_good_files_give_their_rows(tmp_path):
    (tmp_path / "a.txt").write_text("\ufefffirst line\n\nsecond line\n", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "x", "id": 1}\n\n{"text": "y", "id": "two"}\n', encoding="utf-8")
    (tmp_path / "c.json").write_text(json.dumps([{"text": "z"}]), encoding="utf-8")
    files = find_data_files(dataset_dir=str(tmp_path))
    assert [f.name for f in files] == ["a.txt", "b.jsonl", "c.json"]
    assert read_text_rows(files) == ["first line", "second line", "x", "y", "z"]


def test_dataset_dir_is_searched_below_but_not_too_deep(tmp_path):
    folder = tmp_path / "data"
    (folder / "en" / "wiki").mkdir(parents=True)
    (folder / "en" / "wiki" / "part1.txt").write_text("a\n")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "skip.txt").write_text("hidden\n")
    (folder / "notes.md").write_text("not data\n")
    assert [p.name for p in find_data_files(dataset_dir=str(folder))] == ["part1.txt"]
    deep = folder / "/".join(["d"] * (MAX_FOLDER_DEPTH + 1))
    deep.mkdir(parents=True)
    with pytest.raises(ValueError, match=f"nests folders more than {MAX_FOLDER_DEPTH} levels deep"):
        find_data_files(dataset_dir=str(folder))


def test_symlinked_folder_loops_are_not_followed(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("a\n")
    (folder / "loop").symlink_to(folder, target_is_directory=True)
    assert [p.name for p in find_data_files(dataset_dir=str(folder))] == ["a.txt"]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"dataset_dir": "missing"}, "--dataset_dir missing does not exist"),
        ({"train_file": "missing.txt"}, "--train_file missing.txt does not exist"),
        ({"train_file": "data.csv"}, "unsupported suffix '.csv'"),
        ({"dataset_dir": "EMPTY"}, "holds no .txt, .json or .jsonl file"),
    ],
)
def test_missing_or_unusable_paths(tmp_path, monkeypatch, kwargs, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "EMPTY").mkdir()
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        find_data_files(**kwargs)


def test_a_bad_byte_deep_in_a_large_file_is_reported_by_line_number(tmp_path):
    path = tmp_path / "big.txt"
    lines = [f"line {i} of plain text" for i in range(300_000)]  # several read chunks
    lines[250_000] = "caf\xe9"
    path.write_bytes("\n".join(lines).encode("latin-1"))
    with pytest.raises(ValueError, match=r"big.txt line 250001 is not UTF-8 text \(byte 0xe9 at offset \d+"):
        TextFiles([path])
    path.write_bytes("\n".join(lines[:250_000]).encode() + b"\nok\nbad\x00byte\n")
    with pytest.raises(ValueError, match="big.txt line 250002 holds a NUL byte"):
        TextFiles([path])


def test_rows_are_streamed_in_pieces_that_join_to_the_rows(tmp_path):
    path = tmp_path / "mixed.txt"
    long_row = " ".join(f"word{i}" for i in range(200_000))  # over PIECE_CHARS characters, on one line
    filler = "x" * 1022 + "\r\n"  # 4,096 of them after one byte: the last "\r\n" straddles the 4 MiB read chunks
    path.write_bytes(("\n" + filler * 4096).encode() + long_row.encode() + b"\r\nlast")
    pieces = list(TextFiles([path]).pieces())
    assert max(len(text) for text, _ in pieces) <= PIECE_CHARS
    assert all(text.startswith(" ") for text, ends in pieces[4097:-1])  # cut before a space
    rows = list(TextFiles([path]))
    assert rows == ["x" * 1022] * 4096 + [long_row, "last"]  # "\r\n" across two chunks is one line break
    path.write_bytes(path.read_bytes().replace(b"last", b"la\x00st"))
    with pytest.raises(ValueError, match="mixed.txt line 4099 holds a NUL byte"):  # the line count agrees
        TextFiles([path])


def test_json_parsed_whole_has_a_size_limit_named_with_the_fix(tmp_path, monkeypatch):
    import hf_llmkit.data.files as data_files

    monkeypatch.setattr(data_files, "MAX_JSON_BYTES", 64)
    (tmp_path / "a.json").write_text(json.dumps([{"text": "x" * 100}]))
    (tmp_path / "b.jsonl").write_text('{"text": "short"}\n' + json.dumps({"text": "y" * 100}) + "\n")
    with pytest.raises(ValueError, match=r"a.json is over 0 MB, and a .json array is parsed whole; write one JSON"):
        read_file_rows(tmp_path / "a.json")
    with pytest.raises(ValueError, match="b.jsonl line 2 is over 0 MB, and a JSON line is parsed whole; split"):
        read_file_rows(tmp_path / "b.jsonl")


def test_txt_rows_are_lines_or_paragraphs(tmp_path):
    """Issue 46: a held-out text of wrapped prose became one row, and one end-of-text token, per line, which raises
    a real model's eval perplexity; `--text_rows paragraph` in the main jobs, with a line saying how it was cut."""
    path = tmp_path / "prose.txt"
    long_line = " ".join(f"w{i}" for i in range(30_000))  # over PIECE_CHARS characters: handed out in pieces
    path.write_text(f"\n\nFirst line\nof the first.\n  \nSecond\r\n{long_line}\nend\n\n\nThird.", encoding="utf-8")
    assert list(TextFiles([path])) == ["First line", "of the first.", "Second", long_line, "end", "Third."]
    paragraphs = TextFiles([path], rows="paragraph")
    assert list(paragraphs) == ["First line\nof the first.", f"Second\n{long_line}\nend", "Third."]
    assert max(len(text) for text, _ in paragraphs.pieces()) <= PIECE_CHARS + 1  # a piece may lead with "\n"
    with pytest.raises(ValueError, match="rows='page': a .txt row is one of"):
        TextFiles([path], rows="page")
    from hf_llmkit.data.blocks import _source_digest

    assert _source_digest([], TextFiles([path])) != _source_digest([], paragraphs)  # cached apart
