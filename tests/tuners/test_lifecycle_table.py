"""docs/peft.md's lifecycle table is the one `python -m tests.tuners.lifecycle_table` generates from the battery's
case table (so what the page claims is what test_lifecycle.py / test_lifecycle_saving.py run)."""

from __future__ import annotations

from tests.tuners.lifecycle_cases import FAMILIES, METHODS
from tests.tuners.lifecycle_table import BEGIN, DOC, END, OPERATIONS, section, table


def test_the_table_has_a_row_per_method_and_a_column_per_family_and_operation():
    lines = table().splitlines()
    assert lines[0].count("|") == 2 + len(FAMILIES) + len(OPERATIONS)
    assert [line.split(" | ")[0].lstrip("| ") for line in lines[2 : 2 + len(METHODS)]] == [
        m.title for m in METHODS.values()
    ]


def test_docs_peft_md_holds_the_current_table():
    text = DOC.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, f"docs/peft.md needs the markers {BEGIN!r} ... {END!r}"
    assert section(text) == text, (
        "docs/peft.md's lifecycle table is stale: run python -m tests.tuners.lifecycle_table --write"
    )
