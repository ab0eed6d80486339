"""README's "Composition" table is the one generated from the tested matrix (no drift)."""

from __future__ import annotations

from tests.composition.readme_table import BEGIN, END, README, section, table


def test_readme_table_matches_the_matrix():
    text = README.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, "docs/composition.md lost its composition table markers"
    stale = "README's composition table is stale: run python -m tests.composition.readme_table --write"
    assert section(text) == text, stale


def test_table_has_a_column_per_partner_and_a_verdict_per_tested_pair():
    lines = table().splitlines()
    header, rule, *rows = lines[: lines.index("")]
    assert header.count("|") == rule.count("|") and all(row.count("|") == header.count("|") for row in rows)
    assert any("✓" in row for row in rows) and any("refused:" in row for row in rows)
