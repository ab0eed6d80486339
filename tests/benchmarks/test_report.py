"""The docs' numbers are generated (benchmarks/report.py): every marked region of README.md, docs/*.md and
benchmarks/README.md equals what its fragment renders from the committed results files, every fragment used is
registered and its results carry the date, machine and load of their run, and no measurement-looking number is
typed by hand outside a region or code. Then the machinery itself on made-up pages, and the CI-time log parser."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import ci_time  # noqa: E402
import report  # noqa: E402
from areas.catalog import FRAGMENTS  # noqa: E402

PAGES = report.documents()
DATA = Path(__file__).resolve().parent / "data"


def test_the_pages_exist_and_the_benchmarks_page_has_regions():
    names = {str(p.relative_to(report.REPO)) for p in PAGES}
    assert {"README.md", "benchmarks/README.md"} <= names
    assert report.regions(report.REPO / "benchmarks" / "README.md")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(report.REPO)) for p in PAGES])
def test_every_region_equals_what_its_results_render(page):
    _, stale = report.update(page)
    assert not stale, f"{page}: {stale} differ from benchmarks/results; run `python benchmarks/report.py --write`"


def test_every_fragment_used_is_registered_and_its_results_carry_date_machine_and_load():
    used = {region.name for page in PAGES for region in report.regions(page)}
    assert used <= set(FRAGMENTS), f"unregistered fragments: {used - set(FRAGMENTS)}"
    for name in used:
        for file in FRAGMENTS[name].files:
            if not (report.RESULTS / f"{file}.json").exists():
                continue  # the region says "Not measured yet" (test_every_region_equals_what_its_results_render)
            recorded = json.loads((report.RESULTS / f"{file}.json").read_text())["recorded"]
            assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", recorded["date"]), file
            assert recorded["machine"]["cores"] >= 1 and "gpu" in recorded["machine"], file
            assert {"start", "max", "mean"} <= set(recorded["load_1min"]) and "loaded" in recorded, file
            assert recorded["command"].startswith("python benchmarks/"), file


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def test_no_committed_results_file_records_an_absolute_path():
    for file in sorted(report.RESULTS.glob("*.json")):
        absolute = [s for s in _strings(json.loads(file.read_text())) if s.startswith("/") or s[1:3] == ":\\"]
        assert not absolute, f"{file.name} records paths of the machine that ran it: {absolute[:3]}"
    sys.path.insert(0, str(BENCHMARKS))
    from harness.common import REPO, recorded_path

    assert recorded_path(REPO / "benchmarks" / "results" / "x.png") == "benchmarks/results/x.png"
    assert recorded_path("/elsewhere/model") == "model"


def test_every_registered_fragment_whose_results_exist_renders_a_table_or_sentence_and_its_provenance():
    for name, fragment in FRAGMENTS.items():
        if all((report.RESULTS / f"{file}.json").exists() for file in fragment.files):
            body = report.render(name)
            assert "_Measured " in body and "cores" in body, name


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(report.REPO)) for p in PAGES])
def test_no_measurement_is_typed_by_hand_outside_generated_regions(page):
    assert report.lint(page) == []


def test_every_allowed_phrase_says_why_and_is_still_used():
    text = "\n".join(p.read_text() for p in PAGES)
    for phrase, why in report.ALLOWED.items():
        assert len(why) > 10, f"{phrase!r}: say why it is not a measurement"
        assert phrase in text, f"{phrase!r} is allowed but no page uses it any more: remove it from ALLOWED"


# -- the machinery, on made-up pages ------------------------------------------------------------------------------


def region(name: str, body: str) -> str:
    return f"{report.BEGIN.format(name=name)}\n{body}{report.END}\n"


@pytest.fixture
def results(tmp_path, monkeypatch):
    """A results folder with one file, and a fragment rendering it."""
    folder = tmp_path / "results"
    folder.mkdir()
    recorded = {
        "date": "2026-01-02 03:04",
        "command": "python benchmarks/x.py",
        "machine": {"cores": 2, "cpu": "CPU", "torch_threads": 2, "gpu": None, "torch": "2.13.0"},
        "load_1min": {"start": 1.0, "end": 3.0, "max": 3.5, "mean": 2.0, "samples": 9},
        "loaded": True,
    }
    (folder / "x.json").write_text(json.dumps({"value": 1.5, "recorded": recorded}))
    monkeypatch.setitem(
        report.FRAGMENTS, "x", report.Fragment(("x",), lambda r: f"value {r['x']['value']}\n\n" + measured(r["x"]))
    )
    return folder


def measured(data):
    from harness.registry import measured

    return measured(data)


def test_write_fills_a_region_and_check_then_passes_and_names_a_stale_one(tmp_path, results):
    page = tmp_path / "page.md"
    page.write_text("intro\n\n" + region("x", "old\n") + "\noutro\n")
    new, stale = report.update(page, results=results)
    assert stale == ["x"]
    assert "value 1.5" in new and new.startswith("intro\n\n") and new.endswith("\noutro\n")
    assert "LOADED MACHINE" in new and "2026-01-02 03:04" in new and "2 cores (CPU), no GPU" in new
    page.write_text(new)
    assert report.update(page, results=results) == (new, [])
    (results / "x.json").write_text((results / "x.json").read_text().replace("1.5", "2.5"))
    assert report.update(page, results=results)[1] == ["x"]


def test_a_run_that_loads_every_core_itself_is_judged_by_its_start_load(results):
    """CI's run (`loads_itself`): its own workers load both cores, so only a load above the core count at its start
    marks it; the torch named is its environments', not the measuring process's."""
    from harness.registry import measured as render

    data = json.loads((results / "x.json").read_text())
    line = render(data, loads_itself=True)
    assert "LOADED MACHINE" not in line and "torch 2.13.0" not in line and "(the run's own work)" in line
    data["recorded"]["load_1min"]["start"] = 2.5
    assert "LOADED MACHINE" in render(data, loads_itself=True)
    assert "LOADED MACHINE" in render({**data, "recorded": {**data["recorded"], "loaded": True}})


def test_an_unregistered_fragment_a_missing_results_file_and_a_broken_region_say_what_to_do(tmp_path, results):
    page = tmp_path / "page.md"
    page.write_text(region("nope", ""))
    with pytest.raises(KeyError, match="'nope' is not registered"):
        report.update(page, results=results)
    (results / "x.json").unlink()
    page.write_text(region("x", "value 1.5\n"))
    new, stale = report.update(page, results=results)
    assert stale == ["x"] and "value" not in new
    assert "_Not measured yet: `benchmarks/results/x.json` is not committed. Run the benchmark" in new
    with pytest.raises(FileNotFoundError, match="x.json is missing: run the benchmark"):
        report.load(("x",), results)
    page.write_text(report.BEGIN.format(name="x") + "\nno end marker\n")
    with pytest.raises(ValueError, match="1 result markers but 0 well-formed regions"):
        report.regions(page)


@pytest.mark.parametrize(
    "typed",
    ["12.4x longer", "3,549x less", "took 514 s", "3.2 ms a step", "about 2 min", "in 7:13", "192 MiB", "1.6 GB",
     "7% faster", "a score of 0.877", "within 25 minutes", "0.57 of full fine-tuning", "agree to 5e-7",
     # issue 33: multiples in words, a bound before a percentage, a package name before a ratio, plain integers that
     # are measurements, numbers in code spans of plain words
     "3 times faster", "overhead < 0.5%", "DeepSpeed 1.38x", "torch 2.13x", "peft >= 0.21 %", "peak 1126",
     "perplexity of 128", "1200 tokens/s", "`1.38x` faster", "`< 0.5%`", "`514 s`"],
)  # fmt: skip
def test_the_lint_finds_measurement_looking_numbers(tmp_path, typed):
    page = tmp_path / "page.md"
    page.write_text(f"Some text, {typed}, more text.\n")
    assert len(report.lint(page)) == 1


def test_the_lint_leaves_regions_code_shapes_versions_and_allowed_phrases_alone(tmp_path, results, monkeypatch):
    monkeypatch.setitem(report.ALLOWED, "a 5% tolerance", "a test's tolerance, not a measurement")
    page = tmp_path / "page.md"
    page.write_text(
        "Run `--budget-mib 4096` (a flag) with transformers 5.23, peft 0.21.2 and Python 3.11 on 1024x1024 layers,\n"
        "`MoELayer` (with `capacity_factor=1.0`), `torch==2.13.0`, `python x.py --steps 300`, `dkm_bits 3`,\n"
        "| Python | >= 3.11 | transformers >= 5.23.0, < 5.24 |, dp 2 x sp 2, "
        "batch 8 x 128 tokens, a 5% tolerance, 300 steps.\n\n"
        "```\nmake quickstart   # ~2 min\n```\n\n<!-- a comment: 12.4x -->\n" + region("x", "12.4x and 514 s\n")
    )
    assert report.lint(page) == []
    page.write_text(page.read_text() + "\nBut 3.5 s here.\n")
    assert [hit.split(": ", 1)[1] for hit in report.lint(page)] == ["'3.5 s' in 'But 3.5 s here.'"]


def test_check_exits_1_naming_the_stale_region_and_write_fixes_it(tmp_path, results, monkeypatch):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "feature.md"
    page.write_text(region("x", "old\n") + "typed by hand: 12.4x\n")
    monkeypatch.setattr(report, "REPO", tmp_path)
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "render", lambda name, results=results: "\nnew\n\n")
    assert report.main(["--check"]) == 1
    assert report.main(["--write"]) == 0
    assert page.read_text().startswith(report.BEGIN.format(name="x") + "\n\nnew\n\n" + report.END)
    page.write_text(page.read_text().replace("12.4x", "more"))
    assert report.main(["--check"]) == 0


# -- benchmarks/ci_time.py's parsing ------------------------------------------------------------------------------


def read_log(path: Path) -> list[tuple[float, str]]:
    rows = [line.split(" | ", 1) for line in path.read_text().splitlines() if not line.startswith("#")]
    return [(float(t), text) for t, text in rows]


def test_ci_time_reads_install_ruff_and_pytest_from_a_captured_run():
    got = ci_time.parse_log(read_log(DATA / "ci_run.log"), 0)
    assert got["passed"] and got["total_s"] == 514 and got["install_s"] == 88 and got["ruff_s"] == 2
    assert got["pytest"]["counts"] == {"passed": 709, "skipped": 1, "deselected": 2, "warnings": 3}
    assert got["pytest"]["seconds"] == 421.87
    assert got["stages_s"] == {"make test": 513, "make test-lowest": 1}
    assert got["versions"] == [{"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.23.0"}]


def test_ci_time_reads_the_summary_this_pytest_prints_and_keeps_the_largest_of_two_runs(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        textwrap.dedent("""
            import pytest, warnings
            def test_a(): warnings.warn("w")
            def test_b(): assert False
            @pytest.mark.skip(reason="r")
            def test_c(): pass
            def test_d(): pass
        """)
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not test_d", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    small = "======== 2 passed in 3.00s ========"
    lines = [(float(i), line) for i, line in enumerate([*proc.stdout.splitlines(), small])]
    got = ci_time.parse_log(lines, proc.returncode)
    assert not got["passed"] and got["install_s"] is None and len(got["pytest_runs"]) == 2
    assert got["pytest"]["counts"] == {"failed": 1, "passed": 1, "skipped": 1, "deselected": 1, "warnings": 1}


def test_the_ci_line_rounds_to_the_second_before_it_splits_minutes():
    from areas.jobs.fragments import minutes

    assert [minutes(s) for s in (1259.84, 941.29, 59.5, 60.0)] == ["21:00", "15:41", "1:00", "1:00"]
