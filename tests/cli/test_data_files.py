"""hf_llmkit.data_files: every bad data file is refused with one sentence naming the file, the place and the fix."""

from __future__ import annotations

import json

import pytest

from hf_llmkit.data_files import MAX_FOLDER_DEPTH, find_data_files, read_file_rows, read_text_rows

BAD_FILES = {
    "empty.txt": (b"", "empty.txt is empty"),
    "blank.txt": (b"  \n\n \t\n", "blank.txt is empty"),
    "binary.txt": (b"\x89PNG\r\n\x1a\n\x00\x00\xff", "binary.txt is not UTF-8 text (byte 0x89 at offset 0"),
    "nul.txt": (b"text\x00more", "nul.txt holds NUL bytes at offset 4"),
    "latin1.jsonl": ('{"text": "caf\xe9"}\n'.encode("latin-1"), "latin1.jsonl is not UTF-8 text (byte 0xe9"),
    "malformed.jsonl": (b'{"text": "a"}\n{"text": oops}\n', "malformed.jsonl line 2 is not valid JSON"),
    "truncated.json": (b'[{"text": "a"}, {"text": ', "truncated.json line 1 is not valid JSON"),
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
