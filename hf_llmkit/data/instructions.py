"""An embedded instruction set, so supervised fine-tuning runs with no download: questions and answers about the
Python reference that ships with every CPython (`pydoc_data.topics`, the text behind `help()`).

Each topic gives a few `{"instruction", "input", "output"}` records, in a fixed order:

- "What is the title of the Python reference section about '<topic>'?" -> the section's title;
- "Summarize the Python reference section "<title>" in one sentence." -> its first sentence;
- "Which Python reference section is this passage from?" with a paragraph as input -> the title (one record per
  paragraph, up to three per topic);
- "List the subsections of "<title>"." -> their titles, where the section has some.

`write_instruction_file(path)` (or `python -m hf_llmkit.data.instructions FILE`) writes them as JSON lines, a
`--train_file` like a user's.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

__all__ = ["instruction_records", "write_instruction_file"]

_MAX_PASSAGE = 320  # characters of a paragraph used as an input
_PARAGRAPHS_PER_TOPIC = 3


def _title_and_body(text: str) -> tuple[str, str]:
    lines = text.strip().splitlines()
    return lines[0].strip(), "\n".join(lines[2:])


def _prose(body: str) -> list[str]:
    """Paragraphs of running text (no grammar rules, code, underlines or tables), whitespace collapsed."""
    paragraphs = []
    for block in body.split("\n\n"):
        if not block.strip() or block.startswith(" ") or re.search(r"^[=*-]{3,}$", block, flags=re.M):
            continue
        text = " ".join(block.split())
        if len(text) >= 60 and "::=" not in text:
            paragraphs.append(text)
    return paragraphs


def _first_sentence(paragraph: str) -> str:
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    return (match.group(1) if match else paragraph)[:_MAX_PASSAGE]


def _subsections(body: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^(\S[^\n]*)\n=+$", body, flags=re.M)]


def instruction_records() -> list[dict[str, str]]:
    """The embedded records (see the module docstring), deterministic across runs and machines."""
    from pydoc_data.topics import topics

    records = []
    for key in sorted(topics):
        title, body = _title_and_body(topics[key])
        paragraphs = _prose(body)
        records.append(
            {"instruction": f"What is the title of the Python reference section about '{key}'?", "input": "",
             "output": title}
        )  # fmt: skip
        if paragraphs:
            records.append(
                {"instruction": f'Summarize the Python reference section "{title}" in one sentence.', "input": "",
                 "output": _first_sentence(paragraphs[0])}
            )  # fmt: skip
        for paragraph in paragraphs[:_PARAGRAPHS_PER_TOPIC]:
            passage = paragraph if len(paragraph) <= _MAX_PASSAGE else paragraph[:_MAX_PASSAGE].rsplit(" ", 1)[0]
            records.append(
                {"instruction": "Which Python reference section is this passage from?", "input": passage,
                 "output": title}
            )  # fmt: skip
        subsections = _subsections(body)
        if subsections:
            records.append(
                {"instruction": f'List the subsections of "{title}".', "input": "", "output": ", ".join(subsections)}
            )
    return records


def write_instruction_file(path: str | os.PathLike) -> Path:
    """Write `instruction_records()` to `path` as JSON lines; returns the path."""
    path = Path(path)
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in instruction_records()))
    return path


if __name__ == "__main__":
    print(write_instruction_file(sys.argv[1] if len(sys.argv) > 1 else "instructions.jsonl"))
