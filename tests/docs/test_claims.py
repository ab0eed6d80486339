"""What the docs say about the repository's own files, checked against the files (issue 33, "docs that cannot drift"):
the README's layout names every folder and example, benchmarks/README.md lists the scripts `make bench` runs, the
sections a script imports and the CPU-only ones, and every documented `--device cuda` command names a script that
accepts it."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from tests.conftest import REPO
from tests.docs.pages import commands, fenced, pages

BENCHMARKS = REPO / "benchmarks"
BENCH_README = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
SPANS = re.compile(r"`(\w+\.py)`")


def _sentence(text: str, pattern: str) -> str:
    found = re.search(pattern, " ".join(text.split()))
    assert found, f"benchmarks/README.md no longer says {pattern!r}; keep the sentence this test reads"
    return found[1]


def make_bench_scripts() -> set[str]:
    """The scripts `make bench` runs: benchmarks/[!_]*.py with a `__main__` block, less the Makefile's exclusions."""
    recipe = (REPO / "Makefile").read_text(encoding="utf-8").split("\nbench:", 1)[1].split("\n\n", 1)[0]
    skipped = set(re.findall(r"\*/(\w+\.py)", recipe))
    main = re.compile(r'^if __name__ == "__main__":', re.M)
    found = {p.name for p in BENCHMARKS.glob("[!_]*.py") if main.search(p.read_text(encoding="utf-8"))}
    return found - skipped


def device_choices(script: Path) -> set[str]:
    """The `--device` values `script` accepts (`harness.common.add_device_argument`: cpu and cuda), from its source."""
    choices: set[str] = set()
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name == "add_device_argument":
            choices |= {"cpu", "cuda"}
        elif name == "add_argument" and node.args and getattr(node.args[0], "value", None) == "--device":
            for keyword in node.keywords:
                if keyword.arg == "choices":
                    choices |= set(ast.literal_eval(keyword.value))
    return choices


def imported_sections(script: Path) -> set[str]:
    """The benchmark scripts (files of benchmarks/ not starting with `_`) that `script` imports."""
    names = set()
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return {f"{name}.py" for name in names if not name.startswith("_") and (BENCHMARKS / f"{name}.py").is_file()}


def test_benchmarks_readme_lists_the_scripts_make_bench_runs():
    listed = set(SPANS.findall(_sentence(BENCH_README, r"The benchmark scripts are (.*?): the files")))
    assert listed == make_bench_scripts(), f"make bench runs {sorted(make_bench_scripts())}, the page lists {listed}"


def test_benchmarks_readme_names_the_sections_each_script_imports():
    claims = re.findall(r"((?:`\w+\.py`(?:,| and)? ?)+) (?:is a section|are sections) that `(\w+\.py)` imports",
                        " ".join(BENCH_README.split()))  # fmt: skip
    assert claims, "benchmarks/README.md no longer says which sections a script imports"
    for sections, script in claims:
        assert set(SPANS.findall(sections)) == imported_sections(BENCHMARKS / script), (script, sections)


def test_the_cpu_only_scripts_are_the_ones_the_page_names():
    named = set(SPANS.findall(_sentence(BENCH_README, r"`--device \{cpu,cuda\}` .*?, except (.*?) \(CPU only")))
    cpu_only = {name for name in make_bench_scripts() if "cuda" not in device_choices(BENCHMARKS / name)}
    assert named == cpu_only, f"CPU-only scripts: {sorted(cpu_only)}; benchmarks/README.md names {sorted(named)}"
    assert all("cpu" in device_choices(BENCHMARKS / name) for name in make_bench_scripts())


def test_every_documented_cuda_command_names_a_script_that_takes_cuda():
    for page in pages():
        for command in commands(page):
            script = next((a for a in command.argv if a.startswith("benchmarks/") and a.endswith(".py")), None)
            if command.gpu and script and "--device" in command.line:
                assert "cuda" in device_choices(REPO / script), f"{command.page}: {command.line}"


def test_readme_layout_names_every_folder_and_example():
    [layout] = [body for _, _, body in fenced(REPO / "README.md") if body.startswith("hf_llmkit/")]
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    top = {path.split("/")[0] for path in tracked.splitlines() if "/" in path and not path.startswith(".")}
    missing = {f"{name}/" for name in top if not re.search(rf"^{re.escape(name)}/ ", layout, flags=re.M)}
    packages = {p.parent.name for p in (REPO / "hf_llmkit").glob("*/__init__.py")}
    missing |= {f"hf_llmkit/{name}/" for name in packages if not re.search(rf"^  {name}/ ", layout, flags=re.M)}
    examples = layout.split("\nexamples/", 1)[1].split("\n" + "benchmarks/", 1)[0]
    for entry in (REPO / "examples").iterdir():
        if entry.suffix in (".py", ".sh") or entry.is_dir():
            missing |= set() if f"{entry.name}{'/' if entry.is_dir() else ''}" in examples else {entry.name}
    assert not missing, f"README.md's layout omits {sorted(missing)}"
