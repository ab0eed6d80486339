"""Kill-and-resume harness: SIGKILL a real training run at random moments and check the resumed result.

Run as `python tests/callbacks/kill_harness.py WORKDIR --kills 12 --seed 0`; prints one JSON line. It imports
torch/transformers once and forks every training attempt from that warm process (a fresh `python` per attempt
would spend most of the test importing). Each attempt runs the *same* training command (LLMKitTrainer with
`auto_resume=True` and a `FaultToleranceCallback`, a checkpoint every step so kills land inside writes), is
killed either after a random delay or right after a checkpoint write is seen to start, and the next attempt
resumes. The final weights are compared bitwise with an uninterrupted run of the same command.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import default_data_collator

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.callbacks import FaultToleranceCallback, latest_complete_checkpoint
from hf_llmkit.checkpoints.names import MANIFEST_NAME, checkpoint_step, list_checkpoints
from hf_llmkit.testing import tiny_llama
from hf_llmkit.trainers import LLMKitTrainer

if importlib.util.find_spec("deepspeed"):  # accelerate imports it lazily: once here, not in every attempt
    import deepspeed  # noqa: F401

MAX_STEPS = 24
FINAL = "final.safetensors"


class Blocks(torch.utils.data.Dataset):
    """64 fixed token blocks (a deterministic stand-in for a tokenized corpus)."""

    def __init__(self, n: int = 64, length: int = 16):
        generator = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(3, 128, (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def train_once(output_dir: str) -> None:
    """The training command every attempt runs (the 'same command' re-run after each kill)."""
    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = tiny_llama(seed=0, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1).train()
    args = LLMKitTrainingArguments(
        output_dir=output_dir,
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,  # 16 steps per epoch: the run crosses an epoch boundary
        learning_rate=5e-3,
        save_steps=1,
        save_total_limit=2,
        logging_steps=4,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        auto_resume=True,
        save_retry_delay=0.05,
    )
    trainer = LLMKitTrainer(
        model=model,
        args=args,
        train_dataset=Blocks(),
        data_collator=default_data_collator,
        callbacks=[FaultToleranceCallback()],
    )
    trainer.train()
    tmp = Path(output_dir) / (FINAL + ".tmp")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp)
    os.replace(tmp, Path(output_dir) / FINAL)


def _fork_train(output_dir: str) -> int:
    gc.freeze()  # what exists now is never collected in an attempt: no attempt copies or walks the warm heap
    pid = os.fork()
    if pid == 0:  # child: train, then leave without running the parent's cleanup handlers
        code = 0
        try:
            train_once(output_dir)
        except BaseException as err:  # noqa: BLE001 - reported through the exit status
            print(f"attempt failed: {err!r}", file=sys.stderr)
            code = 1
        os._exit(code)
    return pid


def _incomplete(output_dir: str) -> set[str]:
    return {p.name for p in list_checkpoints(output_dir) if not (p / MANIFEST_NAME).exists()}


class Attempt:
    """One forked training attempt; remembers whether it already exited (a pid is reaped only once)."""

    def __init__(self, output_dir: str):
        self.pid = _fork_train(output_dir)
        self.exit_code: int | None = None

    def poll(self) -> bool:
        if self.exit_code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exit_code = os.waitstatus_to_exitcode(status)
        return self.exit_code is not None

    def wait(self) -> int:
        if self.exit_code is None:
            self.exit_code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.exit_code

    def kill(self) -> bool:
        """SIGKILL it unless it already finished; True when it was killed."""
        if self.poll():
            return False
        os.kill(self.pid, signal.SIGKILL)
        self.wait()
        return True


def _wait_for_write(output_dir: str, known: set[str], attempt: Attempt, deadline: float) -> bool:
    """Poll until a checkpoint folder appears without its manifest (a write in progress)."""
    while time.monotonic() < deadline and not attempt.poll():
        complete = [p for p in list_checkpoints(output_dir) if (p / MANIFEST_NAME).exists()]
        floor = checkpoint_step(complete[-1]) if complete else -1
        if any(checkpoint_step(name) > floor for name in _incomplete(output_dir) - known):
            return True
        time.sleep(0.0005)
    return False


def _wait_for_progress(output_dir: str, before: str | None, attempt: Attempt, deadline: float) -> None:
    """Poll until a complete checkpoint newer than `before` exists."""
    while time.monotonic() < deadline and not attempt.poll():
        newest = [p for p in list_checkpoints(output_dir) if (p / MANIFEST_NAME).exists()]
        if newest and (before is None or newest[-1].name != Path(before).name):
            return
        time.sleep(0.002)


def run(workdir: Path, kills: int, seed: int) -> dict:
    rng = random.Random(seed)
    reference, resumed = str(workdir / "reference"), str(workdir / "resumed")
    start = time.monotonic()
    assert Attempt(reference).wait() == 0, "the uninterrupted reference run failed"
    reference_s = time.monotonic() - start
    cycle_s = reference_s / MAX_STEPS  # one step + its checkpoint, overestimated (includes start-up)

    attempts = []
    for index in range(kills):
        known = _incomplete(resumed)
        before = latest_complete_checkpoint(resumed)
        attempt = Attempt(resumed)
        mode = "during-write" if index % 2 else "random"
        if mode == "random":  # after at least one more step is safely saved, at a random point of the next cycle
            _wait_for_progress(resumed, before, attempt, time.monotonic() + 2 * reference_s)
            time.sleep(rng.uniform(0.0, 0.6) * cycle_s)
        else:
            _wait_for_write(resumed, known, attempt, time.monotonic() + 2 * reference_s)
            time.sleep(rng.uniform(0.0, 0.004))
        killed = attempt.kill()
        after = latest_complete_checkpoint(resumed, checksums=True)
        newest = list_checkpoints(resumed)
        attempts.append(
            {
                "mode": mode,
                "killed": killed,
                "exit_code": attempt.exit_code,
                "resumed_from": Path(before).name if before else None,
                "latest_complete_after": Path(after).name if after else None,
                "newest_folder_after": newest[-1].name if newest else None,
                "left_incomplete": sorted(_incomplete(resumed) - known),
            }
        )
    final_ok = Attempt(resumed).wait() == 0  # the last re-run goes to the end

    ref, res = load_file(Path(reference) / FINAL), load_file(Path(resumed) / FINAL) if final_ok else {}
    mismatched = sorted(k for k in ref if k not in res or not torch.equal(ref[k], res[k]))
    return {
        "final_run_ok": final_ok,
        "tensors": len(ref),
        "bitwise_mismatched": mismatched,
        "max_abs_diff": max((float((ref[k] - res[k]).abs().max()) for k in mismatched if k in res), default=0.0),
        "attempts": attempts,
        "reference_seconds": reference_s,
        "total_seconds": time.monotonic() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    print(json.dumps(run(ns.workdir, ns.kills, ns.seed)), flush=True)


if __name__ == "__main__":
    main()
