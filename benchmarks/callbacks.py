"""Callbacks: per-step overhead of each hf_llmkit callback, and checkpoint time with the manifest vs a plain save.

Part 1, per-step overhead: a tiny Llama trains with `LLMKitTrainer` and each callback in turn (on CPU a real
`torch.amp.GradScaler("cpu")` is installed so `LossScaleCallback` takes its active path; on CUDA the run is fp16
with the GradScaler accelerate creates). After a real run, the
callback's per-step events (and `FaultToleranceCallback`'s loss hook) are called with the live trainer objects
in a loop; their cost per step (minimum over repeats) divided by the fastest step of the run is the overhead,
which keeps other processes' noise out of both numbers. The target
is under 1% of a tiny-model step. An end-to-end ratio (median step with all three callbacks / without) is
reported too, from interleaved runs.

Part 2, checkpoint time: the peer is the plain HF `Trainer` checkpoint (`Trainer._save_checkpoint`: model,
optimizer, scheduler, RNG, state). Ours is `LLMKitTrainer._save_checkpoint` (writing marker, the same save, run
record, classifier-based rotation) followed by `FaultToleranceCallback.on_save` (barrier, manifest with sha256
checksums, fsync, rotation), and variants without checksums / without fsync.

    python benchmarks/callbacks.py            # ~2 minutes on 2 idle CPU cores
    python benchmarks/callbacks.py --steps 60 --saves 7
    python benchmarks/callbacks.py --quick    # 8 steps, 1 save of a hidden-64 model: seconds
    python benchmarks/callbacks.py --device cuda   # the default when a GPU is present; step times synchronized

Writes benchmarks/results/callbacks.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from harness.common import add_device_argument, load_note, machine_state, pick_device, synchronize, write_results
from transformers import Trainer, TrainerCallback, default_data_collator

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.callbacks import FaultToleranceCallback, LossScaleCallback, SavePeftModelCallback
from hf_llmkit.testing import tiny_llama
from hf_llmkit.trainers import LLMKitTrainer

PER_STEP_EVENTS = ("on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_substep_end")


class Blocks(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int):
        self.ids = torch.randint(3, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class StepClock(TrainerCallback):
    """Wall time between consecutive `on_step_begin` events = one full training step (queued GPU work included)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.steps: list[float] = []
        self._last: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize(self.device)
        now = time.perf_counter()
        if self._last is not None:
            self.steps.append(now - self._last)
        self._last = now


def _trainer(out: str, callbacks: list, steps: int, scaler: bool, device: torch.device, **overrides) -> Trainer:
    model = tiny_llama(seed=0).train()
    kwargs = dict(
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=10,
        report_to="none",
        disable_tqdm=True,
        use_cpu=device.type == "cpu",
        fp16=scaler and device.type == "cuda",  # accelerate's own GradScaler on a GPU
        seed=0,
        save_strategy="no",
    )
    kwargs.update(overrides)
    trainer = LLMKitTrainer(
        model=model,
        args=LLMKitTrainingArguments(output_dir=out, **kwargs),
        train_dataset=Blocks(512, 64, 512),
        data_collator=default_data_collator,
        callbacks=callbacks,
    )
    if scaler and device.type == "cpu":
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    return trainer


def _event_cost(callback, trainer, repeats: int) -> float:
    """Seconds one training step costs the callback: its per-step events (and FT's loss hook), called with the
    live trainer objects; the minimum over `repeats` batches of 50 (the least disturbed by other processes)."""
    handler, args, state, control = trainer.callback_handler, trainer.args, trainer.state, trainer.control
    kwargs = dict(
        model=trainer.model,
        processing_class=None,
        optimizer=handler.optimizer,
        lr_scheduler=handler.lr_scheduler,
        train_dataloader=None,
        eval_dataloader=None,
    )
    batch = {key: value[None].to(trainer.model.device) for key, value in trainer.train_dataset[0].items()}
    with torch.no_grad():
        output = trainer.model(**batch)
    capture = getattr(getattr(callback, "watch", None), "capture", None)  # FaultToleranceCallback's loss hook
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(50):
            if capture is not None:
                capture(trainer.model, (), output)
            for event in PER_STEP_EVENTS:
                getattr(callback, event)(args, state, control, **kwargs)
        synchronize(trainer.model.device)  # device work a callback queued (a loss check) is its cost too
        best = min(best, (time.perf_counter() - start) / 50)
    return best


def per_step_overhead(steps: int, device: torch.device, rounds: int = 3) -> dict:
    """Callback cost per step vs the fastest (least disturbed) step of the same tiny-model run."""
    rows = {}
    factories = {
        "FaultToleranceCallback": FaultToleranceCallback,
        "LossScaleCallback": LossScaleCallback,
        "SavePeftModelCallback": SavePeftModelCallback,
    }
    for name, factory in factories.items():
        callback, clock = factory(), StepClock(device)
        with tempfile.TemporaryDirectory() as out:
            trainer = _trainer(out, [clock, callback], steps, scaler=True, device=device)
            trainer.train()
            trainer.model.train()
            trainer.state.global_step = 1  # as in the middle of a run
            callback.on_train_begin(
                trainer.args,
                trainer.state,
                trainer.control,
                model=trainer.model,
                optimizer=trainer.callback_handler.optimizer,
            )
            cost = _event_cost(callback, trainer, repeats=rounds + 4)
            callback.on_train_end(trainer.args, trainer.state, trainer.control, model=trainer.model)
        step = min(clock.steps[2:])
        rows[name] = {"step_ms": step * 1e3, "callback_us_per_step": cost * 1e6, "overhead_pct": 100 * cost / step}
    # End to end, interleaved: no callbacks vs all three (fastest step of each run, median over rounds).
    fastest = {"none": [], "all three": []}
    for _ in range(rounds):
        for label in fastest:
            clock = StepClock(device)
            extra = [FaultToleranceCallback(), LossScaleCallback(), SavePeftModelCallback()] if label != "none" else []
            with tempfile.TemporaryDirectory() as out:
                _trainer(out, [clock, *extra], max(steps // 2, 4), scaler=True, device=device).train()
            fastest[label].append(min(clock.steps[2:]))
    none, all3 = statistics.median(fastest["none"]), statistics.median(fastest["all three"])
    return {"callbacks": rows, "end_to_end": {"none_ms": none * 1e3, "all_three_ms": all3 * 1e3, "ratio": all3 / none}}


def checkpoint_times(saves: int, hidden: int, device: torch.device) -> dict:
    """Median seconds of one checkpoint: the plain Trainer's vs ours (Trainer save + manifest) and variants."""
    variants = {
        "Trainer._save_checkpoint (peer)": None,
        "+ manifest sha256 + fsync (default)": dict(checksum="sha256", fsync=True),
        "+ manifest sizes only + fsync": dict(checksum=None, fsync=True),
        "+ manifest sha256, no fsync": dict(checksum="sha256", fsync=False),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as out:
        model = tiny_llama(
            seed=0,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=4096,
        ).train()
        args = LLMKitTrainingArguments(
            output_dir=out,
            max_steps=1,
            per_device_train_batch_size=2,
            report_to="none",
            disable_tqdm=True,
            use_cpu=device.type == "cpu",
            save_strategy="no",
        )
        trainer = LLMKitTrainer(
            model=model, args=args, train_dataset=Blocks(8, 32, 4096), data_collator=default_data_collator
        )
        trainer.train()  # optimizer state exists, so the checkpoint has its real size
        size = None
        for round_ in range(saves):
            for name, settings in variants.items():  # interleaved: noise hits every variant alike
                trainer.state.global_step = 100 * round_ + list(variants).index(name) + 1
                synchronize(device)
                start = time.perf_counter()
                if settings is None:
                    Trainer._save_checkpoint(trainer, trainer.model, trial=None)  # the peer, unchanged
                else:
                    trainer._save_checkpoint(trainer.model, trial=None)
                    callback = FaultToleranceCallback(**settings)
                    callback.on_save(trainer.args, trainer.state, trainer.control, model=trainer.model)
                times[name].append(time.perf_counter() - start)
                folder = Path(out) / f"checkpoint-{trainer.state.global_step}"
                size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
                shutil.rmtree(folder)
    peer = statistics.median(times["Trainer._save_checkpoint (peer)"])
    return {
        "checkpoint_mb": size / 2**20,
        "rows": {
            name: {"seconds": statistics.median(v), "ratio_vs_peer": statistics.median(v) / peer}
            for name, v in times.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps per overhead run")
    parser.add_argument("--saves", type=int, default=3, help="checkpoints timed per variant")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the checkpointed model")
    parser.add_argument("--quick", action="store_true", help="8 steps, 1 round, 1 save of a hidden-64 model")
    add_device_argument(parser)
    ns = parser.parse_args()
    device = pick_device(ns.device)
    if ns.quick:
        ns.steps, ns.saves, ns.hidden = 8, 1, 64
    torch.set_num_threads(max(1, torch.get_num_threads()))
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    before = machine_state()
    overhead = per_step_overhead(ns.steps, device, rounds=1 if ns.quick else 3)
    print(f"\n### Per-step overhead (tiny Llama, batch 8 x 64 tokens, real GradScaler, {device.type})\n")
    print("| callback | fastest step (ms) | callback time per step (us) | overhead |")
    print("|---|---|---|---|")
    for name, row in overhead["callbacks"].items():
        print(f"| {name} | {row['step_ms']:.1f} | {row['callback_us_per_step']:.1f} | {row['overhead_pct']:.3f}% |")
    e2e = overhead["end_to_end"]
    print(
        f"\nEnd to end (interleaved, fastest step, median of {1 if ns.quick else 3} round(s)): "
        f"none {e2e['none_ms']:.1f} ms, "
        f"all three {e2e['all_three_ms']:.1f} ms, ratio {e2e['ratio']:.3f}"
    )

    ckpt = checkpoint_times(ns.saves, ns.hidden, device)
    print(f"\n### Checkpoint time ({ckpt['checkpoint_mb']:.1f} MB checkpoint, median of {ns.saves})\n")
    print("| save | seconds | ratio vs plain Trainer save |")
    print("|---|---|---|")
    for name, row in ckpt["rows"].items():
        print(f"| {name} | {row['seconds']:.3f} | {row['ratio_vs_peer']:.2f} |")

    after = machine_state()
    print(f"\n{load_note(before, after)}")
    path = write_results(
        "callbacks", {"overhead": overhead, "checkpoint": ckpt, "args": vars(ns), "machine": [before, after]}
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
