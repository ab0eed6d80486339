"""`hf_llmkit.checkpoints.names` is the one module that spells folder names: no other library file builds or globs a
`checkpoint-` name from a literal (issue 34, 1)."""

from __future__ import annotations

import ast

from tests.conftest import REPO

NAMES = "hf_llmkit/checkpoints/names.py"


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = [
        tree,
        *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))),
    ]
    return {id(n.body[0].value) for n in nodes if n.body and isinstance(n.body[0], ast.Expr)}


def spelled_names(path) -> list[str]:
    """String literals of `path` (docstrings aside) that begin a `checkpoint-` name or glob one."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value
            if text.startswith("checkpoint-") or "checkpoint-*" in text or "/checkpoint-" in text:
                found.append(f"line {node.lineno}: {text!r}")
    return found


def test_no_library_file_but_names_spells_checkpoint_folders(tmp_path):
    files = sorted(p for folder in ("hf_llmkit", "callbacks", "trainers") for p in (REPO / folder).rglob("*.py"))
    spelled = {p.relative_to(REPO).as_posix(): spelled_names(p) for p in files}
    assert {path: found for path, found in spelled.items() if found and path != NAMES} == {}
    old = tmp_path / "old.py"  # what save_peft.py, job.py and folders.py did before
    old.write_text(
        'a = f"checkpoint-{step}"\nb = root.glob("checkpoint-*")\nc = name.startswith(("checkpoint-", "."))\n'
    )
    assert len(spelled_names(old)) == 3
