"""The static import graph (parsed with `ast`, nothing imported): `callbacks/` and `trainers/` meet only in
`hf_llmkit/checkpoints/`, which imports neither, and `callbacks/` holds callbacks only, one per file (issue 22, 1).

`callbacks/` and `trainers/` install as `hf_llmkit.callbacks` / `hf_llmkit.trainers` (setup.py's `MAPPED`); the
graph resolves those names to their folders, so every edge points at a file of this repository."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO


def _mapped_folders() -> dict[str, str]:
    """setup.py's `MAPPED = {"hf_llmkit.callbacks": "callbacks", ...}`, read without running it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["MAPPED"]:
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no MAPPED table")


MAPPED = _mapped_folders()


def module_name(path: Path) -> str:
    relative = path.relative_to(REPO).with_suffix("")
    parts = list(relative.parts)
    for name, folder in MAPPED.items():
        if parts[0] == folder:
            parts = [*name.split("."), *parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_file(name: str) -> Path | None:
    """The file a `hf_llmkit.*` module name resolves to in this repository (None: not found)."""
    parts = name.split(".")
    for mapped, folder in MAPPED.items():
        prefix = mapped.split(".")
        if parts[: len(prefix)] == prefix:
            parts = [folder, *parts[len(prefix) :]]
            break
    base = REPO.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _library_files() -> list[Path]:
    folders = [REPO / "hf_llmkit", *(REPO / folder for folder in MAPPED.values())]
    return sorted(p for folder in folders for p in folder.rglob("*.py"))


def imports(path: Path) -> set[str]:
    """Every `hf_llmkit.*` module `path` imports, at any depth of the file (`from a import b` counts `a.b` when
    `b` is a module)."""
    found: set[str] = set()
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if module_file(f"{base}.{alias.name}"))
    return {name for name in found if name == "hf_llmkit" or name.startswith("hf_llmkit.")}


GRAPH = {module_name(path): imports(path) for path in _library_files()}


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _edges(source: str, target: str) -> list[tuple[str, str]]:
    return [(a, b) for a, deps in GRAPH.items() if _under(a, source) for b in deps if _under(b, target)]


def test_every_library_import_resolves_to_a_file_of_the_repository():
    unresolved = sorted((a, b) for a, deps in GRAPH.items() for b in deps if module_file(b) is None)
    assert unresolved == []
    assert "hf_llmkit.callbacks.fault_tolerance" in GRAPH and "hf_llmkit.trainers.recovery" in GRAPH


def test_callbacks_and_trainers_meet_only_in_checkpoints():
    assert _edges("hf_llmkit.callbacks", "hf_llmkit.trainers") == []
    assert _edges("hf_llmkit.trainers", "hf_llmkit.callbacks") == []
    assert _edges("hf_llmkit.callbacks", "hf_llmkit.checkpoints"), "callbacks/ must use hf_llmkit.checkpoints"
    assert _edges("hf_llmkit.trainers", "hf_llmkit.checkpoints"), "trainers/ must use hf_llmkit.checkpoints"


def test_checkpoints_depends_on_nothing_else_of_the_library():
    edges = _edges("hf_llmkit.checkpoints", "hf_llmkit")
    assert [(a, b) for a, b in edges if not _under(b, "hf_llmkit.checkpoints")] == []


def test_the_checkpoint_names_are_spelled_in_one_module():
    spelled = {
        module_name(path)
        for path in _library_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in ("trainer_state.json", "llmkit_manifest.json")
    }
    assert spelled == {"hf_llmkit.checkpoints.names"}


def test_callbacks_hold_one_callback_per_file():
    for path in sorted((REPO / MAPPED["hf_llmkit.callbacks"]).glob("*.py")):
        if path.name == "__init__.py":
            continue
        classes = [node for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)]
        callbacks = [c.name for c in classes if any(getattr(base, "id", "") == "TrainerCallback" for base in c.bases)]
        assert len(callbacks) == 1, (path.name, callbacks)
