"""The command-line package depends on the features, never the reverse (read from the sources with `ast`)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The library outside hf_llmkit/cli/: the package itself and the two folders installed as its subpackages.
FEATURES = [path for folder in ("hf_llmkit", "callbacks", "trainers") for path in (REPO / folder).rglob("*.py")]


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file (`from hf_llmkit import cli` counts as hf_llmkit.cli)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _is_cli(name: str) -> bool:
    return name == "hf_llmkit.cli" or name.startswith("hf_llmkit.cli.")


def test_no_feature_module_imports_the_cli():
    cli = REPO / "hf_llmkit" / "cli"
    upward = {
        str(path.relative_to(REPO)): sorted(filter(_is_cli, imported_modules(path)))
        for path in FEATURES
        if cli not in path.parents
    }
    assert {path: names for path, names in upward.items() if names} == {}
    assert len(upward) > 50  # the walk saw the library


def test_the_cli_is_built_on_the_features():
    used = set().union(*(imported_modules(path) for path in (REPO / "hf_llmkit" / "cli").glob("*.py")))
    for feature in ("hf_llmkit.tuners", "hf_llmkit.quantization.config", "hf_llmkit.parallel.moe.upcycle"):
        assert feature in used
