"""TRL's `SFTTrainer` as a client of `FaultToleranceCallback` alone (no hf_llmkit trainer): kill -9 in the middle of
a checkpoint write, SIGTERM, and the same script run again each time (issue 19, section 3).

    python tests/callbacks/sft_harness.py WORKDIR        # prints one JSON line

The script every attempt runs is what a TRL user writes: `SFTTrainer(..., callbacks=[FaultToleranceCallback()])`
and `trainer.train(resume_from_checkpoint=True)` once the output folder holds a checkpoint. Attempts are forked from
this warm process (imports once). Runs, each compared with an uninterrupted reference, tensor for tensor:

1. `killed`: SIGKILL while `checkpoint-4` is being written (its folder is there, its manifest is not), then the
   script again: it must resume from `checkpoint-2` although `get_last_checkpoint` names the half-written folder;
2. `sigterm`: SIGTERM once `checkpoint-2` is complete: the run saves, exits 143 with one line, the script again.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch
import transformers
from datasets import Dataset
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import SFTConfig, SFTTrainer

from hf_llmkit.callbacks import FaultToleranceCallback
from hf_llmkit.checkpoints.names import MANIFEST_NAME, checkpoint_folder
from hf_llmkit.data.corpus import corpus_texts, corpus_tokenizer
from hf_llmkit.testing import tiny_llama

MAX_STEPS, SAVE_STEPS = 8, 2
FINAL, RECORD = "final.safetensors", "attempt.json"


class _Record(TrainerCallback):
    """Writes the step each attempt started from next to the output folder."""

    def __init__(self, path: Path):
        self.path = path

    def on_train_begin(self, args, state, control, **kwargs):
        self.path.write_text(json.dumps({"resumed_at": state.global_step}))


def train_script(output_dir: str) -> None:
    """The user's script: the same every attempt."""
    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tokenizer = corpus_tokenizer()
    model = tiny_llama(
        seed=0, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1
    ).train()
    config = SFTConfig(
        output_dir=output_dir,
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS,
        save_total_limit=2,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        max_length=32,
        logging_steps=2,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"text": corpus_texts()[:48]}),
        processing_class=tokenizer,
        callbacks=[FaultToleranceCallback(), _Record(Path(output_dir).with_suffix(".json"))],
    )
    trainer.train(resume_from_checkpoint=any(Path(output_dir).glob("checkpoint-*")))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, Path(output_dir) / FINAL)


class Attempt:
    """The script in a forked child (its output in `<output_dir>.log`); exit status as the script's own."""

    def __init__(self, output_dir: Path):
        self.output_dir, self.code = output_dir, None
        gc.freeze()  # what exists now is never collected in an attempt: no attempt copies or walks the warm heap
        self.pid = os.fork()
        if self.pid == 0:
            code = 0
            try:
                with open(output_dir.with_suffix(".log"), "a") as log:  # stdout and stderr
                    os.dup2(log.fileno(), 1)
                    os.dup2(log.fileno(), 2)
                train_script(str(output_dir))
            except SystemExit as err:  # a RunEndingError: its exit status
                code = err.code if isinstance(err.code, int) else 1
            except BaseException as err:  # noqa: BLE001 - reported through the exit status
                print(f"attempt failed: {err!r}", file=sys.stderr)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def poll(self) -> bool:
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
        return self.code is not None

    def wait(self, timeout: float = 240.0) -> int:
        deadline = time.monotonic() + timeout
        while not self.poll():
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
            time.sleep(0.01)
        return self.code

    def wait_for(self, condition, timeout: float = 240.0) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.poll() or time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True


def _same(reference: Path, resumed: Path) -> list[str]:
    ref, res = load_file(reference / FINAL), load_file(resumed / FINAL) if (resumed / FINAL).is_file() else {}
    return sorted(k for k in ref if k not in res or not torch.equal(ref[k], res[k]))


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def run(workdir: Path, seed: int) -> dict:
    rng = random.Random(seed)
    corpus_tokenizer()  # trained and cached once, before the forks
    reference = workdir / "reference"
    result: dict = {"reference_exit": Attempt(reference).wait()}

    killed = workdir / "killed"
    target, first = checkpoint_folder(killed, 2 * SAVE_STEPS), checkpoint_folder(killed, SAVE_STEPS)
    attempt = Attempt(killed)
    writing = attempt.wait_for(lambda: target.is_dir() and (first / MANIFEST_NAME).is_file())
    time.sleep(rng.uniform(0.0, 0.003))
    os.kill(attempt.pid, signal.SIGKILL)
    attempt.wait()
    last = get_last_checkpoint(str(killed))
    result["killed"] = {
        "mid_write": writing and target.is_dir() and not (target / MANIFEST_NAME).is_file(),
        "get_last_checkpoint": Path(last).name if last else None,
        "rerun_exit": Attempt(killed).wait(),
        "rerun": _read(killed.with_suffix(".json")),
        "mismatched": _same(reference, killed),
    }

    stopped = workdir / "sigterm"
    attempt = Attempt(stopped)
    attempt.wait_for(lambda: (checkpoint_folder(stopped, SAVE_STEPS) / MANIFEST_NAME).is_file())
    os.kill(attempt.pid, signal.SIGTERM)
    exit_code = attempt.wait()
    lines = stopped.with_suffix(".log").read_text(errors="replace").splitlines()
    result["sigterm"] = {
        "exit": exit_code,
        "stop_lines": [line for line in lines if "stopped at step" in line],
        "tracebacks": sum("Traceback" in line for line in lines),
        "rerun_exit": Attempt(stopped).wait(),
        "rerun": _read(stopped.with_suffix(".json")),
        "mismatched": _same(reference, stopped),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    ns.workdir.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run(ns.workdir, ns.seed)), flush=True)


if __name__ == "__main__":
    main()
