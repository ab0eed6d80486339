"""README.md runs as written: every command block in order in one scratch folder, every Python block.

Commands run as a newcomer types them, one after the other in the same folder (so a command that resumed another
one's checkpoint would show), with the steps capped by appended flags. Each must train (steps run, no resume of an
earlier command's run) or stop with one line. The placeholders the README uses (`path/to/model`, `corpus.txt`,
`held_out.txt`) are created in the folder first. `make test` / `make bench` / `pip` lines are not run here, nor
multi-machine launches (tested in tests/parallel). Launcher commands (accelerate, torchrun, run_pt.sh) run in the
`slow` test; the fast one runs every single-process command and Python block.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hf_llmkit.testing import corpus_texts, corpus_tokenizer, free_port, tiny_llama
from tests.conftest import REPO

README = REPO / "README.md"
SIZES = ["--vocab_size", "512", "--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "2",
         "--max_position_embeddings", "64"]  # fmt: skip
CAP = ["--block_size", "32", "--max_steps", "2", "--save_steps", "2", "--per_device_train_batch_size", "4",
       "--per_device_eval_batch_size", "8", "--max_train_samples", "32", "--max_eval_samples", "8",
       "--logging_steps", "1", "--warmup_steps", "0", "--disable_tqdm", "true"]  # fmt: skip


def blocks(language: str) -> list[str]:
    """The fenced code blocks of README.md in one language, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


@dataclass
class Command:
    line: str
    kind: str  # run_clm | launcher | run_pt | shell | skip
    argv: list[str]


def commands() -> list[Command]:
    """Every command of every bash block, comments dropped and continuation lines joined."""
    found = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                found.append(_classify(line))
    return found


def _classify(line: str) -> Command:
    argv = shlex.split(line)
    if argv[:2] == ["make", "quickstart"]:
        return Command(line, "run_clm", [])  # the Makefile's quickstart target: `$(PY) examples/run_clm.py`
    if argv[0] in ("make", "pip") or re.search(r"--nnodes[ =]*[2-9]|--num_machines[ =]*[2-9]|hostfile", line):
        return Command(line, "skip", argv)
    if argv[:2] == ["python", "examples/run_clm.py"]:
        return Command(line, "run_clm", argv[2:])
    if argv[0] in ("accelerate", "torchrun"):
        return Command(line, "launcher", argv)
    if argv[:2] == ["bash", "examples/run_pt.sh"]:
        return Command(line, "run_pt", argv[2:])
    return Command(line, "shell", argv)


def _capped(args: list[str]) -> list[str]:
    """The command's flags with the steps capped and, for a model built from scratch, tiny sizes."""
    from_scratch = "--model_name_or_path" not in args and not (args and args[0].endswith(".json"))
    return [*args, *(SIZES if from_scratch else []), *CAP]


def prepare_folder(folder: Path) -> None:
    """A scratch folder like a fresh clone (examples/ linked) holding the README's placeholder inputs."""
    (folder / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    model = folder / "path" / "to" / "model"
    tiny_llama().save_pretrained(model)
    corpus_tokenizer(vocab_size=512).save_pretrained(model)
    texts = corpus_texts()
    (folder / "corpus.txt").write_text("\n".join(texts[:400]), encoding="utf-8")
    (folder / "held_out.txt").write_text("\n".join(texts[-40:]), encoding="utf-8")


def _table_steps(text: str) -> int:
    row = re.search(r"^\| steps +\| (\d+)", text, flags=re.M)
    assert row is not None, text[-3000:]
    return int(row.group(1))


def run_in_process(run_clm, command: Command, capsys, folders: dict[str, str]) -> str:
    """Run one `python examples/run_clm.py ...` command; return "trained", "help" or "stopped: <line>"."""
    if "--help" in command.argv:
        with pytest.raises(SystemExit) as done:
            run_clm.run(command.argv)
        assert done.value.code == 0 and "PEFT:" in capsys.readouterr().out
        return "help"
    try:
        results = run_clm.run(_capped(command.argv))
    except run_clm.UsageError as err:
        assert "\n" not in str(err)
        return f"stopped: {err}"
    _check_own_folder(command, results["output_dir"], results["resumed_at"], folders)
    assert results["global_step"] >= 1, (command.line, results)
    return "trained"


def _check_own_folder(command: Command, output_dir: str, resumed_at: int, folders: dict[str, str]) -> None:
    """A command resumes only a run of the same command (the quickstart is `python examples/run_clm.py`)."""
    same = " ".join(["python examples/run_clm.py", *command.argv]) if command.kind == "run_clm" else command.line
    earlier = folders.setdefault(output_dir, same)
    assert earlier == same, f"{command.line!r} trains in {output_dir}, the folder of {earlier!r}"
    assert not resumed_at or earlier == same


def run_subprocess(command: Command, folder: Path, folders: dict[str, str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "MASTER_PORT": str(free_port())}
    if command.kind == "run_pt":
        argv = ["bash", "examples/run_pt.sh", *command.argv, "--max_steps", "2", "--disable_tqdm", "true"]
        env.update(BLOCK_SIZE="32", GRAD_ACC="2")
    else:
        head = ["-m", "accelerate.commands.launch", "--main_process_port", env["MASTER_PORT"]]
        if command.argv[0] == "torchrun":
            head = ["-m", "torch.distributed.run", "--master_port", env["MASTER_PORT"]]
        script = command.argv.index("examples/run_clm.py")
        argv = [sys.executable, *head, *command.argv[2 if head[1].startswith("acc") else 1 : script]]
        argv += ["examples/run_clm.py", *_capped(command.argv[script + 1 :])]
    proc = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if "run_clm.py: error:" in line]
    if proc.returncode != 0:
        assert len(errors) == 1, (command.line, proc.stderr[-4000:])
        return f"stopped: {errors[0]}"
    assert _table_steps(proc.stdout) >= 1, (command.line, proc.stdout[-3000:])
    output_dir = re.search(r"^\| outputs +\| (\S+)", proc.stdout, flags=re.M).group(1)
    _check_own_folder(command, output_dir, int("resumed at" in proc.stdout), folders)
    return "trained"


def _run_readme(run_clm, folder: Path, capsys, monkeypatch, *, launchers: bool) -> dict[str, str]:
    prepare_folder(folder)
    monkeypatch.chdir(folder)
    outcome: dict[str, str] = {}
    folders: dict[str, str] = {}  # output_dir -> the command that trained there first
    for command in commands():
        if command.kind == "skip" or (command.kind in ("launcher", "run_pt") and not launchers):
            outcome[command.line] = "not run here"
        elif command.kind == "run_clm":
            outcome[command.line] = run_in_process(run_clm, command, capsys, folders)
        elif command.kind == "shell":
            subprocess.run(command.line, shell=True, cwd=folder, check=True, timeout=60)
            outcome[command.line] = "ran"
        else:
            outcome[command.line] = run_subprocess(command, folder, folders)
    return outcome


def test_readme_single_process_commands_in_order(run_clm, tmp_path, capsys, monkeypatch):
    outcome = _run_readme(run_clm, tmp_path, capsys, monkeypatch, launchers=False)
    assert list(outcome.values()).count("trained") >= 7, outcome
    assert all(not v.startswith("stopped") for v in outcome.values()), outcome  # distinct folders: nothing refused
    assert "make quickstart" in outcome and outcome["make quickstart"] == "trained"
    runs = [p.parent.name for p in (tmp_path / "outputs").glob("*/trainer_state.json")]
    assert len(runs) >= list(outcome.values()).count("trained") - 1  # one folder per command (quickstart twice)


@pytest.mark.slow
def test_readme_all_commands_in_order_with_launchers(run_clm, tmp_path, capsys, monkeypatch):
    outcome = _run_readme(run_clm, tmp_path, capsys, monkeypatch, launchers=True)
    assert all(not v.startswith("stopped") for v in outcome.values()), outcome
    assert sum(v == "trained" for v in outcome.values()) >= 12, outcome


def test_readme_commands_are_recognised():
    kinds = {command.line: command.kind for command in commands()}
    assert kinds["make quickstart"] == "run_clm" and "bash examples/run_pt.sh" in kinds
    assert {"run_clm", "launcher", "run_pt", "shell", "skip"} <= set(kinds.values())


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python_block_runs_as_written(tmp_path, monkeypatch, index):
    prepare_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = blocks("python")[index]
    exec(compile(code, f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})
