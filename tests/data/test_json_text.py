"""JSON and JSON lines are read as the JSON standard says, by both main jobs' readers (run_clm's
`hf_llmkit.data.files`, run_sft's `hf_llmkit.data.sft`): a malformed array is refused naming its line and column
(Python's `json.load` rejects the same files), and JSON lines split on "\\n" only, so U+2028, U+0085 and the other
characters `str.splitlines` breaks on are data inside a string."""

from __future__ import annotations

import json

import pytest

from hf_llmkit.data.files import read_file_rows
from hf_llmkit.data.json_text import json_array_values, json_lines
from hf_llmkit.data.sft import read_instruction_records

RECORDS = [{"instruction": f"Say {i}.", "input": "", "output": f"word {i}"} for i in range(4)]
WHOLE = json.dumps(RECORDS, indent=1)
ELEMENTS = [json.dumps(record) for record in RECORDS]
# (file text, the place and the reason the refusal names)
MALFORMED = {
    "no closing bracket": (WHOLE.rstrip()[:-1], "line 22 column 1 is not valid JSON (the array has no closing ']')"),
    "cut inside an element": (WHOLE[:200], "is not valid JSON (Unterminated string"),
    "commas missing": ("[" + "\n".join(ELEMENTS) + "]", "line 2 column 1 is not valid JSON (expecting ',' or ']'"),
    "junk after the bracket": (WHOLE + "\njunk", "line 23 column 1 is not valid JSON (text after the closing ']')"),
    "second array after": (WHOLE + " []", "column 3 is not valid JSON (text after the closing ']')"),
    "trailing comma": ("[" + ",".join(ELEMENTS) + ",]", "is not valid JSON (a ',' before the closing ']')"),
    "double comma": ("[" + ",,".join(ELEMENTS) + "]", "is not valid JSON (Expecting value"),
}
# Every character str.splitlines breaks on, besides "\n" and "\r": data inside a JSON string.
SEPARATORS = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_array_is_refused_naming_its_place_by_both_readers(tmp_path, case):
    text, expected = MALFORMED[case]
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)  # the standard parser refuses it too
    sft = tmp_path / "records.json"
    sft.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError) as info:
        read_instruction_records(sft)
    assert expected in str(info.value) and "\n" not in str(info.value)
    clm = tmp_path / "texts.json"
    clm.write_text(text.replace('"instruction"', '"text"'), encoding="utf-8")
    with pytest.raises(ValueError) as info:
        read_file_rows(clm)
    assert expected in str(info.value)


def test_a_valid_array_gives_every_element_with_its_line():
    text = "[\n" + ",\n".join(ELEMENTS) + "\n]\n"
    assert list(json_array_values(text, where="x")) == [(line, r) for line, r in zip(range(2, 6), RECORDS)]
    assert list(json_array_values(" [ ] ", where="x")) == []


def test_unicode_line_separators_inside_jsonl_strings_are_data(tmp_path):
    texts = [f"before{char}after {i}" for i, char in enumerate(SEPARATORS)]
    records = [dict(RECORDS[0], output=text) for text in texts]
    for lines in (json.dumps, lambda r: json.dumps(r, ensure_ascii=False)):
        sft = tmp_path / "records.jsonl"
        sft.write_text("\r\n".join(lines(r) for r in records) + "\r\n", encoding="utf-8", newline="")
        assert [r["output"] for r in read_instruction_records(sft)] == texts  # as json.loads reads each line
        clm = tmp_path / "texts.jsonl"
        clm.write_text("\n".join(lines({"text": t}) for t in texts), encoding="utf-8", newline="")
        assert read_file_rows(clm) == texts


def test_json_lines_split_on_newline_only():
    assert list(json_lines('{"a": 1}\r\n\n{"b": "x\u2028y"}')) == [(1, '{"a": 1}'), (2, ""), (3, '{"b": "x\u2028y"}')]


def test_a_bad_jsonl_line_is_named_by_its_number_counting_newlines_only(tmp_path):
    path = tmp_path / "texts.jsonl"
    path.write_text('{"text": "a\u2028b"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="texts.jsonl line 2 is not valid JSON"):
        read_file_rows(path)
    path.write_text(json.dumps(RECORDS[0], ensure_ascii=False).replace("Say", "Say\x85") + "\n{oops}\n")
    with pytest.raises(ValueError, match="records|texts.jsonl line 2 is not valid JSON"):
        read_instruction_records(path)
