#!/usr/bin/env python
"""The GPU check: one command that, on one CUDA GPU (an H100 or H200 with the machine's own torch), installs the
carried wheels, runs the CUDA tests and every benchmark's `--device cuda` mode at GPU sizes, and renders the docs'
CUDA tables; each part within its own time budget, so that a slow part cannot starve the rest.

    make gpu-check                                   # = python benchmarks/gpu_check.py --out outputs/gpu_check
    python benchmarks/gpu_check.py --out DIR         # the same; DIR gets the logs, summary.json, gpu_check.tar.gz
    python benchmarks/gpu_check.py --device cpu      # the plumbing mode (CI): tiny sizes, results to a temp folder

Parts, in order (`PARTS`; `--only NAME...` picks some): `install` (when `.whl/` holds wheels: `pip install
--no-index --no-deps --target TMP .whl/*.whl`, put first on every later part's PYTHONPATH; then this package
with `pip install --no-deps --no-build-isolation -e .` unless python finds it already), `env` (versions and the GPU),
`tests` (`pytest -m gpu tests/gpu`), `moe`, `dkm`, `sequence_parallel`, `peft_methods`, `quickstart` (each
benchmark with `--device cuda`, writing `benchmarks/results/<name>.cuda.json` beside the CPU files), then `report`
(`benchmarks/report.py --write`: the `*.cuda` fragments in docs/gpu.md). A part gets its own budget in seconds plus
whatever the parts before it left unused, never so much that the budgets of the parts after it no longer fit in
`--total` (480 s: the check must end within 8 minutes); a part past its time is stopped (its process group killed)
and recorded as `timeout`, and the next part starts. Each part's output goes to `DIR/<part>.log`; `DIR/summary.json`
says per part: status (ok, failed, timeout, skipped: nothing to do, not run: no time left), seconds, budget,
command. `DIR/gpu_check.tar.gz` holds the summary, the logs, every `benchmarks/results/*.cuda.*` file and the
rendered pages, to unpack at the repository's
root. The exit code is 0 only when every part passed.

The plumbing mode (`--device cpu`) runs the same parts with `--device cpu` at tiny sizes, writes the results as
`<name>.cuda.json` into a temporary folder (`$HF_LLMKIT_BENCH_RESULTS`, `$HF_LLMKIT_BENCH_TAG=cuda`), never into
`benchmarks/results/`, and renders every CUDA fragment from there instead of writing pages
(tests/benchmarks/test_gpu_check.py runs it). There each part's `python ...` command runs in a process forked from
this one after it imported the stack once (torch, transformers, peft, hf_llmkit: 6-7 s of CPU a cold interpreter
would pay per part), with the part's own argv, environment, process group, log and exit status; the benchmarks'
own modules are imported afresh in it. On a GPU every part is a fresh interpreter (the installed wheels come first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from areas.catalog import CUDA_VARIANTS  # noqa: E402
from harness.common import pick_device, results_name, write_results  # noqa: E402


@dataclass(frozen=True)
class Part:
    name: str
    budget_s: float  # on CUDA; the plumbing mode gives each part CPU_BUDGET_S
    args: tuple[str, ...] = ()  # the arguments on a GPU
    cpu: tuple[str, ...] = ()  # the plumbing mode's, appended to `args` (the later flag wins): tiny sizes


BENCH = "benchmarks/{}.py"
# GPU sizes. moe: Mixtral-like experts at H 2048, I 4096, bf16; 8 and 64 experts at 4K tokens, 8 at 16K.
# sequence_parallel: a 1.1B Llama in bf16 on one GPU, every ALST switch, the longest sequence in 2 GiB of peak
# activation memory (the ratios to plain are what matter; a larger budget costs minutes of probes). The plumbing mode
# passes the same flags and overrides the sizes, so a flag a script does not take fails in CI, not on the GPU. Where
# it passes `--quick` (which sets the sizes; peft_methods also gets back its MiniLM workload), the part runs the
# script's whole quick mode: tests/benchmarks/test_quick_modes.py checks that run as the script's quick run.
PARTS = (
    Part("install", 45),
    Part("env", 15),
    Part("tests", 80, ("-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider", "--timeout", "60")),
    Part("moe", 55,
         ("--dtype", "bf16", "--hidden", "2048", "--inter", "4096", "--experts", "8,64", "--fixed-tokens", "4096",
          "--tokens", "16384", "--threads", "1", "--rounds", "5", "--train-steps", "0"),
         ("--hidden", "64", "--inter", "128", "--experts", "8,16", "--fixed-tokens", "128", "--tokens", "256",
          "--rounds", "1", "--warmup", "0")),
    Part("dkm", 50, ("--only", "speed", "memory", "--peer-full"), ("--quick", "--only", "speed")),
    Part("sequence_parallel", 105,
         ("--sp", "1", "--model", "1b", "--dtype", "bf16", "--budget-mib", "2048", "--probe", "512",
          "--time-seq", "4096", "--rounds", "3"),
         ("--model", "tiny", "--budget-mib", "4", "--probe", "64", "--time-seq", "128", "--rounds", "1",
          "--offload-seq", "256", "--fork-ranks")),
    Part("peft_methods", 45, ("--workloads", "llama", "--batch", "8", "--seq", "512", "--rounds", "6"),
         ("--quick", "--workloads", "llama", "bert")),
    Part("quickstart", 70, ("--rounds", "1"), ("--quick",)),
    Part("report", 15),
)  # fmt: skip
BENCHMARKS = ("moe", "dkm", "sequence_parallel", "peft_methods", "quickstart")
CPU_BUDGET_S = 600.0


def part_command(part: Part, device: str, site: Path) -> list[str] | None:
    """The argv of a part (None: nothing to run, e.g. no wheels to install)."""
    args = part.args if device == "cuda" else (*part.args, *part.cpu)
    if part.name in BENCHMARKS:
        return [PY, BENCH.format(part.name), "--device", device, *args]
    if part.name == "tests":
        return [PY, *args]
    if part.name == "env":
        code = (
            "import importlib.metadata as m, torch, sys; print('python', sys.version.split()[0]); "
            "print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', "
            "torch.cuda.get_device_name() if torch.cuda.is_available() else None)\n"
            "for n in ('transformers','peft','accelerate','datasets','deepspeed','coremltools','trl','optimum',"
            "'triton','pyarrow','huggingface-hub','setuptools','hf-llmkit'):\n"
            "    try: print(n, m.version(n))\n"
            "    except m.PackageNotFoundError: print(n, 'not installed')\n"
            "import importlib.util; print('hf_llmkit from', importlib.util.find_spec('hf_llmkit').origin)"
        )
        return [PY, "-c", code]
    if part.name == "report":
        if device == "cuda":
            return [PY, "benchmarks/report.py", "--write"]
        names = ["gpu_check.cuda", *(f"{name}.cuda" for name in CUDA_VARIANTS)]  # the fragments of docs/gpu.md
        return [PY, "benchmarks/report.py", "--render", *names, "--results", os.environ["HF_LLMKIT_BENCH_RESULTS"]]
    if part.name == "install":
        wheels = sorted(str(p) for p in (REPO / ".whl").glob("*.whl"))
        script = []
        if wheels:
            script.append(
                [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                 "--upgrade", "--target", str(site), *wheels]
            )  # fmt: skip
        if subprocess.run([PY, "-c", _FOUND], cwd=REPO).returncode != 0:
            script.append([PY, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "."])
        if not script:
            return None
        return ["bash", "-c", " && ".join(" ".join(_quote(a) for a in cmd) for cmd in script)]
    raise ValueError(f"unknown part {part.name!r}")


# whether this python finds hf_llmkit, without importing it (an import costs seconds of torch, peft, bitsandbytes)
_FOUND = "import importlib.util, sys; sys.exit(importlib.util.find_spec('hf_llmkit') is None)"


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def run_part(cmd: list[str], log: Path, budget: float, env: dict[str, str], fork: bool = False) -> tuple[str, float]:
    """Runs `cmd` in its own process group, output to `log`; (status, seconds). Past `budget` the whole group is
    killed (a benchmark's spawned ranks too) and the status is `timeout`. `fork` (the plumbing mode): a `python ...`
    command runs in a child forked from this process (`_forked`) instead of a new interpreter."""
    start = time.monotonic()
    with log.open("w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        if fork and cmd[0] == PY:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _forked(cmd[1:], out.fileno(), env)
            rc = _wait(pid, max(budget, 1.0))
        else:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            try:
                rc = proc.wait(timeout=max(budget, 1.0))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        if rc is None:
            status = "timeout"
            out.write(f"\n[gpu_check] stopped after {budget:.0f} s (its budget)\n")
        else:
            status = "ok" if rc == 0 else f"failed (exit {rc})"
    return status, time.monotonic() - start


def _wait(pid: int, budget: float) -> int | None:
    """The exit status of the forked part `pid`, or None when it ran past `budget` (its process group killed)."""
    deadline = time.monotonic() + budget
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.05)


def _forked(args: list[str], log: int, env: dict[str, str]) -> None:
    """A forked part: `python ARGS` (a script, `-m module` or `-c code`) run as `__main__` in this child, in its own
    process group, with `env`, output to `log`; the benchmarks' modules imported afresh (a script's load sampler and
    results record are its own). Leaves with the status the interpreter would give."""
    code = 0
    try:
        os.setsid()
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(REPO)
        ours = [name for name, module in sys.modules.items() if name != "__main__"
                and HERE in Path(getattr(module, "__file__", None) or "/").resolve().parents]  # fmt: skip
        for name in ours:
            del sys.modules[name]
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - our own code
        else:
            sys.argv = list(args)
            sys.path[0] = str(Path(args[0]).resolve().parent)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if exit_.code is None or isinstance(exit_.code, int) else 1
        if code == 1 and not isinstance(exit_.code, int):  # sys.exit("message"): printed, status 1
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the interpreter does: a traceback and status 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code or 0)


def _preimport() -> None:
    """The stack every forked part imports, once here (the plumbing mode)."""
    import torch

    torch.set_num_threads(1)
    import hf_llmkit  # noqa: F401  (first: it imports peft and transformers after its filters of their noise)


def record(summary: dict, start: float, results: Path) -> None:
    """`results/gpu_check.cuda.json`: the parts run so far, with the run's date, GPU and torch (`write_results`)."""
    write_results("gpu_check", {**summary, "seconds": round(time.monotonic() - start, 1)},
                  path=results / f"{results_name('gpu_check')}.json")  # fmt: skip


def bundle(out: Path, results: Path) -> Path:
    """`out/gpu_check.tar.gz`: the summary and logs (under gpu_check/), the `.cuda` results and the rendered pages,
    with paths relative to the repository's root."""
    path = out / "gpu_check.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for file in sorted(out.glob("*.log")) + [out / "summary.json"]:
            tar.add(file, arcname=f"outputs/gpu_check/{file.name}")
        for file in sorted(results.glob("*.cuda.*")):
            tar.add(file, arcname=f"benchmarks/results/{file.name}")
        for page in ["README.md", "benchmarks/README.md", *(str(p.relative_to(REPO)) for p in REPO.glob("docs/*.md"))]:
            tar.add(REPO / page, arcname=page)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the plumbing mode (CI)")
    parser.add_argument("--out", type=Path, default=os.environ.get("HF_LLMKIT_GPU_CHECK_OUT", "outputs/gpu_check"),
                        help="logs, summary.json and gpu_check.tar.gz ($HF_LLMKIT_GPU_CHECK_OUT)")  # fmt: skip
    parser.add_argument("--total", type=float, default=480.0, help="seconds for all parts together")
    parser.add_argument("--only", nargs="+", choices=[p.name for p in PARTS], help="these parts alone, in order")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda: torch sees no CUDA device here; `--device cpu` is the plumbing mode",
                  file=sys.stderr)  # fmt: skip
            return 2
        pick_device("cuda")  # results as `<name>.cuda.json`
    out = args.out if args.out.is_absolute() else REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    site = Path(tempfile.mkdtemp(prefix="gpu_check_site_"))  # the carried wheels' packages: not under --out
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # a GPU machine may have no network: never wait for one
        env.setdefault(name, "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if (REPO / ".whl").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    results = HERE / "results"
    if args.device == "cpu":  # never over the committed results: a temporary folder, files named as on a GPU
        results = Path(env.get("HF_LLMKIT_BENCH_RESULTS") or tempfile.mkdtemp(prefix="gpu_check_"))
        env.update(HF_LLMKIT_BENCH_RESULTS=str(results), HF_LLMKIT_BENCH_TAG="cuda")
        os.environ.update(HF_LLMKIT_BENCH_RESULTS=str(results), HF_LLMKIT_BENCH_TAG="cuda")
        _preimport()  # every part forks from this process
    parts = [p for p in PARTS if args.only is None or p.name in args.only]
    budgets = [p.budget_s if args.device == "cuda" else CPU_BUDGET_S for p in parts]
    total = args.total if args.device == "cuda" else sum(budgets)
    start, summary = time.monotonic(), {"device": args.device, "total_s": total, "parts": {}}
    recorded = False
    for index, part in enumerate(parts):
        if part.name == "report":  # the parts so far, as docs/gpu.md renders them (`gpu_check.cuda` fragment)
            record(summary, start, results)
            recorded = True
        left = total - (time.monotonic() - start)
        budget = min(max(left - sum(budgets[index + 1 :]), budgets[index]), left)
        cmd = part_command(part, args.device, site)
        if cmd is None:
            row = {"status": "skipped", "seconds": 0.0, "budget_s": round(budget, 1), "why": "nothing to do"}
        elif budget < 1:
            row = {"status": "not run", "seconds": 0.0, "budget_s": 0.0, "why": "no time left"}
        else:
            status, seconds = run_part(cmd, out / f"{part.name}.log", budget, env, fork=args.device == "cpu")
            row = {"status": status, "seconds": round(seconds, 1), "budget_s": round(budget, 1)}
            row["command"] = " ".join(cmd[1:] if cmd[0] == PY else cmd)
        summary["parts"][part.name] = row
        print(f"[gpu_check] {part.name}: {row['status']} in {row['seconds']:.0f} s (budget {row['budget_s']:.0f} s)",
              flush=True)  # fmt: skip
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if row["status"] not in ("ok", "skipped", "not run"):  # the end of its log, where a failure says why
            tail = (out / f"{part.name}.log").read_text(errors="replace").splitlines()[-15:]
            print("\n".join(f"    {line[:300]}" for line in tail), flush=True)
    if not recorded:
        record(summary, start, results)
    summary["seconds"] = round(time.monotonic() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[gpu_check] wrote {bundle(out, results)} ({summary['seconds']:.0f} s)")
    bad = [name for name, row in summary["parts"].items() if row["status"] not in ("ok", "skipped")]
    if bad:
        print(f"[gpu_check] not ok: {', '.join(bad)} (see {out}/<part>.log)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
