"""A table that a test module generates into a docs page between two marker lines (the composition table, the PEFT
lifecycle table): the replacement the page's test compares, and the `--write` command line of the generator."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path


def replace_between(text: str, begin: str, end: str, body: str, what: str) -> str:
    """`text` with what stands between the `begin` and `end` marker lines replaced by `body`."""
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), flags=re.S)
    if not pattern.search(text):
        raise ValueError(f"{what} has no table markers ({begin!r} ... {end!r})")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text)


def run(description: str, page: Path, render: Callable[[], str], section: Callable[[str], str]) -> None:
    """Print the table (`render`), or with `--write` put it into `page` (`section`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--write", action="store_true", help=f"update {page.name} instead of printing the table")
    if parser.parse_args().write:
        page.write_text(section(page.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        print(render())
