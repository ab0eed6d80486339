"""Runs the commands of the documentation as a newcomer types them: each page in reading order, in one scratch
folder with the other pages of its group (`pages.RUN_GROUPS`), so that two documented commands that would collide
(one output folder for two runs) show up; across groups, the output folders each group recorded are compared
(`share_folders`).

The folder looks like a fresh clone (examples/, benchmarks/ and .ci/ linked) and holds the placeholders pages use
(`path/to/model`, `corpus.txt`, `held_out.txt`). The test shortens only step counts and model sizes: it appends
the step caps (`STEPS`, always: the last value of a flag wins), and the tiny sizes and sample caps (`SIZES`,
`SMALL`) for flags the command did not type; every other flag, the output folder included, stays as typed (a
typed `--block_size 16384` runs with 16,384-token blocks). Each command must train in a folder no other documented
command trained in (resuming only its own run) or stop with one line. Commands for a CUDA device (`Command.gpu`)
are left to the tests marked gpu (`run_gpu`).

A command of docs/main_job.md that is also the subject of a test of the examples, which makes its own assertions
on the same run (`SHARED_COMMANDS`: `bash examples/run_pt.sh`), runs once per pytest run (`shared_run`), by
whichever test comes first, as this test runs it (`documented_run`), in the page's folder or in a fresh clone's look
after the quickstart (all of the page's folder that the command reads); the output folder it wrote is copied into
the page's folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from hf_llmkit.testing import corpus_texts, corpus_tokenizer, free_port, tiny_llama
from tests import warm
from tests.conftest import REPO, load_example
from tests.docs.pages import MACHINE_PLACEHOLDER, Command, group_commands

# Tiny sizes for a model built from scratch; a size the command types wins.
SIZES = {"--vocab_size": "512", "--hidden_size": "64", "--intermediate_size": "128", "--num_hidden_layers": "2",
         "--max_position_embeddings": "128", "--block_size": "32"}  # fmt: skip
# run_sft.py's examples hold the prompt template too (its default alone is 75 tokens): a longer budget
SFT_LENGTH = "96"
# Step counts: always appended, after the command's own flags (the last value of a flag wins).
STEPS = ["--max_steps", "1", "--save_steps", "1"]
# Small batches and sample counts, and quiet logs: appended for the flags the command did not type.
SMALL = {"--per_device_train_batch_size": "1", "--per_device_eval_batch_size": "2", "--max_train_samples": "16",
         "--max_eval_samples": "2", "--logging_steps": "1", "--warmup_steps": "0",
         "--disable_tqdm": "true"}  # fmt: skip
TIMEOUT_S = 600
# run_pt.sh's step cap: two optimizer steps (tests/examples/test_seed_recipe.py asserts on the same run)
RUN_PT_STEPS = "2"


def prepare_folder(folder: Path) -> None:
    """A scratch folder like a fresh clone (examples/, benchmarks/ and .ci/ linked) holding the placeholder inputs
    the pages name."""
    for name in ("examples", "benchmarks", ".ci"):
        (folder / name).symlink_to(REPO / name, target_is_directory=True)
    model = folder / "path" / "to" / "model"
    tiny_llama().save_pretrained(model)
    corpus_tokenizer(vocab_size=512).save_pretrained(model)
    texts = corpus_texts()
    (folder / "corpus.txt").write_text("\n".join(texts[:400]), encoding="utf-8")
    (folder / "held_out.txt").write_text("\n".join(texts[-40:]), encoding="utf-8")


def capped(args: list[str], script: str = "examples/run_clm.py") -> list[str]:
    """A training script's flags with the caps appended and, for a model built from scratch, the tiny sizes the
    command did not type (run_sft.py's examples are `--max_seq_length` long, run_clm.py's blocks `--block_size`)."""
    from_scratch = "--model_name_or_path" not in args and not (args and args[0].endswith(".json"))
    typed = {a.split("=")[0] for a in args if a.startswith("--")}
    sft = script.endswith("run_sft.py")
    length, budget = ("--max_seq_length", SFT_LENGTH) if sft else ("--block_size", SIZES["--block_size"])
    tiny = {**{k: v for k, v in SIZES.items() if k != "--block_size"}, length: budget}
    sizes = [x for flag, value in tiny.items() if flag not in typed for x in (flag, value)]
    if not from_scratch:  # run_sft.py: its default, min(256, the model's context)
        sizes = sizes[-2:] if length not in typed and not sft else []
    if "--warmup_ratio" in typed:
        typed.add("--warmup_steps")  # one of the two
    small = [x for flag, value in SMALL.items() if flag not in typed for x in (flag, value)]
    return [*args, *sizes, *small, *STEPS]


def run_group(
    group: str, run_clm, folder: Path, capsys, monkeypatch, record: Path, shared: Path | None = None
) -> None:
    """Run the commands of `group`'s pages in reading order in `folder` (a fresh clone's look), then compare the
    output folders they trained in with those of the groups that `record` holds (`share_folders`). `shared`: the
    run-wide folder of runs other tests read too (`shared_run`)."""
    prepare_folder(folder)
    monkeypatch.chdir(folder)
    commands = group_commands(group)
    run = PageRun(folder, run_clm, capsys, shared)
    outcome = run.run(commands)
    stopped = {line: what for line, what in outcome.items() if what.startswith("stopped")}
    assert not stopped, stopped  # every command works as typed, each in a folder of its own
    assert len(outcome) == len({c.line for c in commands}), outcome
    share_folders(record, group, run.folders)


def shared_run(
    shared: Path, line: str, produce: Callable[[], tuple[Path, subprocess.CompletedProcess]]
) -> tuple[Path, subprocess.CompletedProcess]:
    """The run of the command `line` made once per pytest run: the first caller (of either xdist worker) makes it
    with `produce` (the folder it ran in, the finished process) under a lock; later callers get the recorded one."""
    shared.mkdir(parents=True, exist_ok=True)
    key = re.sub(r"[^A-Za-z0-9]+", "-", line).strip("-")
    record = shared / f"{key}.json"
    with open(shared / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits here while the first makes the run
        if not record.is_file():
            folder, proc = produce()
            made = {"folder": str(folder), "args": proc.args, "returncode": proc.returncode,
                    "stdout": proc.stdout, "stderr": proc.stderr}  # fmt: skip
            written = shared / f".{key}.{os.getpid()}.tmp"
            written.write_text(json.dumps(made), encoding="utf-8")
            os.replace(written, record)
    made = json.loads(record.read_text(encoding="utf-8"))
    proc = subprocess.CompletedProcess(made["args"], made["returncode"], made["stdout"], made["stderr"])
    return Path(made["folder"]), proc


# docs/main_job.md's commands that a test of the examples asserts on too (tests/examples/test_seed_recipe.py), each
# made once per pytest run (`documented_run`). Of what the page's folder holds when each comes, they read only a
# fresh clone's look and the quickstart's run (run_pt.sh continues its model). The 2-rank `accelerate launch` stays
# tests/examples/test_run_clm.py's own launch: that file runs on the lowest versions too (.ci/capabilities), where
# the docs test does not.
SHARED_COMMANDS = ("bash examples/run_pt.sh",)


def documented_run(shared: Path, run_clm, line: str) -> tuple[Path, subprocess.CompletedProcess]:
    """The run of docs/main_job.md's command `line` (one of `SHARED_COMMANDS`) as the docs test runs it, made once per
    pytest run: the folder it ran in and the finished process. Made here (the docs test did not come first), it runs
    in a fresh clone's look after the page's quickstart, `python examples/run_clm.py`."""
    command = next(c for c in group_commands("main_job") if c.line == line and line in SHARED_COMMANDS)

    def produce() -> tuple[Path, subprocess.CompletedProcess]:
        folder = Path(tempfile.mkdtemp(prefix="docs-run-", dir=shared))
        prepare_folder(folder)
        with contextlib.chdir(folder):
            run_clm.run(capped([]))  # the quickstart, as the page's first command runs in its folder
        return folder, PageRun(folder, run_clm, None)._proc(command)

    return shared_run(shared, command.line, produce)


def share_folders(record: Path, group: str, folders: dict[str, dict]) -> None:
    """Write the output folders `group`'s commands trained in to `record` (a folder every group of this pytest run
    shares), and check them against those of every group that wrote before: of two groups, the one that ends later
    compares the pair. Two different commands meet in one output folder where, run in one folder, the later would
    resume the earlier's run (the same flags) or be refused (a typed `--output_dir`); a default folder holding a run
    of other flags moves on (`outputs/run_clm-dkm-2`), so two default folders of different runs are no collision."""
    record.mkdir(parents=True, exist_ok=True)
    written = record / f".{group}.{os.getpid()}.tmp"
    written.write_text(json.dumps(folders, sort_keys=True), encoding="utf-8")
    os.replace(written, record / f"{group}.json")
    for other in sorted(record.glob("*.json")):
        if other.stem == group:
            continue
        theirs = json.loads(other.read_text(encoding="utf-8"))
        for output_dir, mine in folders.items():
            their = theirs.get(output_dir)
            if their is None or their["command"] == mine["command"]:
                continue
            met = mine["typed"] or their["typed"] or mine["flags"] == their["flags"]
            assert not met, f"{mine['command']!r} ({group}) trains in {output_dir}, the folder of {their['command']!r}"


class PageRun:
    """The commands of one group of pages, run in order in `folder`; `outcome` maps each command line to what
    happened."""

    def __init__(self, folder: Path, run_clm, capsys, shared: Path | None = None):
        self.folder, self.run_clm, self.capsys, self.shared = folder, run_clm, capsys, shared
        self.outcome: dict[str, str] = {}
        # output_dir -> the command that trained there first: {"command", "typed" (its --output_dir), "flags"}
        self.folders: dict[str, dict] = {}
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip

    def run(self, commands: list[Command]) -> dict[str, str]:
        done: set[int] = set()
        for i, command in enumerate(commands):
            if i in done:
                continue
            if command.gpu:  # a CUDA device's command: test_gpu_command_runs_as_typed (marked gpu)
                self.outcome[command.line] = "gpu"
                continue
            if command.kind == "machines":  # the machines of one job: every such command of the block, together
                job = [j for j, c in enumerate(commands) if c.kind == "machines" and c.block == command.block]
                done.update(job)
                self._machines([commands[j] for j in job])
            else:
                self.outcome[command.line] = getattr(self, f"_{command.kind}")(command)
        return self.outcome

    # -- one method per kind ---------------------------------------------------------------------------------
    def _run_clm(self, command: Command) -> str:
        args = command.argv[2:]
        if "--help" in args:
            with pytest.raises(SystemExit) as done:
                self.run_clm.run(args)
            assert done.value.code == 0 and "PEFT" in self.capsys.readouterr().out
            return "help"
        return self._job(command, self.run_clm, args)

    def _script(self, command: Command) -> str:
        """`python examples/run_sft.py ...`: the other main job, in this process as run_clm.py is."""
        return self._job(command, load_example(Path(command.argv[1]).stem), command.argv[2:], command.argv[1])

    def _job(self, command: Command, job, args: list[str], script: str = "examples/run_clm.py") -> str:
        try:
            with _environ(command.env):
                results = job.run(capped(args, script))
        except job.UsageError as err:
            assert "\n" not in str(err)
            return f"stopped: {err}"
        self._own_folder(command, results["output_dir"], bool(results["resumed_at"]))
        assert results["global_step"] >= 1, (command.line, results)
        return "trained"

    def _launcher(self, command: Command) -> str:
        return self._trained(command, self._made(command))

    def _launch_here(self, command: Command) -> subprocess.CompletedProcess:
        """The launcher (the environment's console script, which PATH finds) as the interpreter runs it, in a fresh
        child of the warm interpreter (tests/warm.py): it starts its ranks as new interpreters, as typed."""
        argv = _with_free_port(command.argv)
        script = next(i for i, a in enumerate(argv) if a.startswith("examples/") and a.endswith(".py"))
        argv = [*argv[: script + 1], *capped(argv[script + 1 :], argv[script])]
        launcher = shutil.which(argv[0], path=self.env["PATH"])
        env = {**self.env, **command.env}
        return warm.run_script(launcher, argv[1:], env=env, cwd=self.folder, timeout=TIMEOUT_S)

    def _python(self, command: Command) -> str:
        """`python -c CODE ...` / `python -m MODULE ...` in this process, as the interpreter runs them (`sys.argv`,
        `__main__`); it must end as the shell's command would have to: without an error, exit status 0."""
        option, target, *rest = command.argv[1:]
        argv = sys.argv
        try:
            with _environ(command.env), warnings.catch_warnings():
                # runpy's note that the module was imported before (by this process, not by the command)
                warnings.filterwarnings("ignore", r".*found in sys\.modules", RuntimeWarning)
                if option == "-c":
                    sys.argv = ["-c", *rest]
                    exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
                else:
                    sys.argv = [target, *rest]
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
        except SystemExit as done:
            assert done.code in (None, 0), (command.line, done.code)
        finally:
            sys.argv = argv
        return "ran"

    def _run_pt(self, command: Command) -> str:
        return self._trained(command, self._made(command))

    def _made(self, command: Command) -> subprocess.CompletedProcess:
        """The finished process of a launcher or run_pt.sh command: run here, or, for one of `SHARED_COMMANDS`, the
        run made once per pytest run (here, when this test comes first)."""
        if self.shared is None or command.line not in SHARED_COMMANDS:
            return self._proc(command)

        here = []

        def produce() -> tuple[Path, subprocess.CompletedProcess]:
            here.append(self._proc(command))
            # the run's output folder, kept in the shared folder: this test's own folder goes when it passes
            kept = Path(tempfile.mkdtemp(prefix="docs-run-", dir=self.shared))
            _copy_output_dir(here[0], self.folder, kept)
            return kept, here[0]

        folder, proc = shared_run(self.shared, command.line, produce)
        if not here:  # made by a test of the examples: what the run wrote, as if written here
            _copy_output_dir(proc, folder, self.folder)
        return proc

    def _proc(self, command: Command) -> subprocess.CompletedProcess:
        return self._run_pt_here(command) if command.kind == "run_pt" else self._launch_here(command)

    def _run_pt_here(self, command: Command) -> subprocess.CompletedProcess:
        env = {**command.env, "BLOCK_SIZE": "32", "GRAD_ACC": "2", "MASTER_PORT": str(free_port())}
        argv = ["bash", *command.argv[1:], "--max_steps", RUN_PT_STEPS, "--disable_tqdm", "true"]
        return self._subprocess(argv, env)

    def _bench(self, command: Command) -> str:
        argv = [*command.argv, "--quick"]
        if command.argv[1:] == ["benchmarks/report.py", "--write"]:  # would rewrite the pages: check they are written
            argv = ["python", "benchmarks/report.py", "--check"]
        if command.gpu:  # a new interpreter: the warm one's children must not meet a CUDA context made before a fork
            proc = self._subprocess(argv, command.env)
        else:  # `python SCRIPT ...` as the interpreter runs it, in a fresh child of the warm interpreter
            # (tests/warm.py): a cold one would import torch and transformers again for a quick mode of seconds
            env = {**self.env, **command.env}
            proc = warm.run_script(argv[1], argv[2:], env=env, cwd=self.folder, timeout=TIMEOUT_S)
        assert proc.returncode == 0, (command.line, proc.stdout[-3000:], proc.stderr[-3000:])
        return "measured (quick)"

    def run_gpu(self, command: Command) -> str:
        """A CUDA device's command, as typed (a benchmark in its quick mode)."""
        if command.kind == "bench":
            return self._bench(command)
        return self.run([Command(command.line, command.kind, command.argv, command.env, command.block)])[command.line]

    def _make(self, command: Command) -> str:
        if command.argv[1:2] == ["test"]:  # the suite running this test: CI runs it (.ci/run)
            assert "make test" in (REPO / ".ci" / "run").read_text()
        # -B: every recipe as on a fresh clone (the install steps too, where the variables the page sets are used)
        argv = ["make", "-n", "-B", *command.argv[1:]]
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (command.line, proc.stderr)
        for assignment in command.argv[1:]:  # a variable the page sets reaches the recipe
            if "=" in assignment:
                assert assignment.split("=", 1)[1].strip('"') in proc.stdout, (command.line, proc.stdout)
        return "checked (make -n -B)"

    def _shell(self, command: Command) -> str:
        subprocess.run(command.line, shell=True, cwd=self.folder, env=self.env, check=True, timeout=TIMEOUT_S)
        return "ran"

    def _machines(self, job: list[Command]) -> None:
        """Each command of `job` is one machine's; a single command runs on two machines."""
        port, shared = str(free_port()), self.folder / "shared"
        machines = job if len(job) > 1 else job * 2
        argvs = []
        for command in machines:
            line = re.sub(rf"{MACHINE_PLACEHOLDER}:\d+", f"127.0.0.1:{port}", command.line)
            line = line.replace(MACHINE_PLACEHOLDER, "127.0.0.1").replace("/mnt/shared", str(shared))
            line = re.sub(r"(--(?:main_process|master)_port)[ =]\d+", rf"\1 {port}", line)
            parsed = _parse(line)
            script = next(i for i, a in enumerate(parsed.argv) if a.startswith("examples/") and a.endswith(".py"))
            argvs.append(
                ([*parsed.argv[: script + 1], *capped(parsed.argv[script + 1 :], parsed.argv[script])], parsed.env)
            )
        procs: list[subprocess.CompletedProcess | None] = [None] * len(argvs)

        def start(i: int) -> None:
            procs[i] = self._subprocess(*argvs[i])

        threads = [threading.Thread(target=start, args=(i,)) for i in range(len(argvs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for command, proc in zip(machines, procs):  # one machine (global rank 0's) prints the results table
            assert proc.returncode == 0, (command.line, proc.stdout[-3000:], proc.stderr[-4000:])
        tables = [proc for proc in procs if re.search(r"^\| steps +\|", proc.stdout, flags=re.M)]
        assert len(tables) == 1, [proc.stdout[-2000:] for proc in procs]
        for command in machines:
            self.outcome[command.line] = self._trained(command, tables[0], own_folder=False)

    # -- helpers ---------------------------------------------------------------------------------------------
    def _subprocess(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            argv, cwd=self.folder, env={**self.env, **env}, capture_output=True, text=True, timeout=TIMEOUT_S
        )

    def _trained(self, command: Command, proc: subprocess.CompletedProcess, *, own_folder: bool = True) -> str:
        errors = [line for line in proc.stderr.splitlines() if re.search(r"\.py: error: ", line)]
        if proc.returncode != 0:
            assert len(errors) == 1, (command.line, proc.stdout[-3000:], proc.stderr[-4000:])
            return f"stopped: {errors[0]}"
        steps = re.search(r"^\| steps +\| (\d+)", proc.stdout, flags=re.M)
        assert steps and int(steps.group(1)) >= 1, (command.line, proc.stdout[-3000:])
        output_dir = re.search(r"^\| outputs +\| (\S+)", proc.stdout, flags=re.M)
        if own_folder and output_dir:
            self._own_folder(command, output_dir.group(1), "resumed at" in proc.stdout)
        return "trained"

    def _own_folder(self, command: Command, output_dir: str, resumed: bool) -> None:
        """A command resumes only a run of the same command (the quickstart is `python examples/run_clm.py`)."""
        same = " ".join(command.argv)
        flags = json.loads((self.folder / output_dir / "llmkit_flags.json").read_text(encoding="utf-8"))
        earlier = self.folders.setdefault(
            output_dir, {"command": same, "typed": _typed_output_dir(command), "flags": flags}
        )
        assert earlier["command"] == same, (
            f"{command.line!r} trains in {output_dir}, the folder of {earlier['command']!r}"
        )
        assert not resumed or earlier["command"] == same


def _copy_output_dir(proc: subprocess.CompletedProcess, source: Path, target: Path) -> None:
    """Copy the output folder a finished run names in its results table (relative to `source`) to `target`."""
    output_dir = re.search(r"^\| outputs +\| (\S+)", proc.stdout, flags=re.M)
    if output_dir and not Path(output_dir.group(1)).is_absolute():
        shutil.copytree(source / output_dir.group(1), target / output_dir.group(1), symlinks=True)


def _typed_output_dir(command: Command) -> bool:
    """Whether the command names its output folder (a flag, its JSON file of flags, or run_pt.sh's own flag)."""
    if command.kind == "run_pt" or any(a.split("=")[0] == "--output_dir" for a in command.argv):
        return True
    files = [a for a in command.argv if a.endswith(".json") and not a.startswith("-")]
    return any("output_dir" in json.loads(Path(f).read_text(encoding="utf-8")) for f in files if Path(f).is_file())


@contextlib.contextmanager
def _environ(assignments: dict[str, str]):
    """The command's leading `VAR=value` assignments in `os.environ` while it runs in this process."""
    previous = {name: os.environ.get(name) for name in assignments}
    os.environ.update(assignments)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _parse(line: str) -> Command:
    from tests.docs.pages import classify

    return classify(line)


def _with_free_port(argv: list[str]) -> list[str]:
    """A single-machine launch on a free port (two launches at once must not meet in one rendezvous)."""
    port = str(free_port())
    flag = {"accelerate": "--main_process_port", "torchrun": "--master_port", "deepspeed": "--master_port"}[argv[0]]
    at = 2 if argv[:2] == ["accelerate", "launch"] else 1
    return [*argv[:at], flag, port, *argv[at:]]
