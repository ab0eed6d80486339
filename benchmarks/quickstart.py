"""How long `make quickstart` trains, next to the same training with the plain transformers Trainer.

`make quickstart` runs `python examples/run_clm.py`: a 5M-parameter Llama trained from scratch for 300 steps
(batch 8 x 128 tokens) on the embedded corpus, with evaluation before and after, checkpoints every 100 steps and
hf_llmkit's callbacks. The peer is a script with the same model, data, hyperparameters, evaluations and
checkpoints on `transformers.Trainer` alone. Each variant runs as a fresh process (as a user starts it), in
interleaved rounds with the order rotated; after one untimed run that builds the tokenizer and data caches.
Reported: the process wall time and the Trainer's `train_runtime`, min / median, and the per-round ratio to the
peer; torch threads and the load before and after.

    python benchmarks/quickstart.py              # 2 rounds: 4 quickstarts and a short first run (about 10 minutes
                                                 # on 2 idle cores; over an hour on 2 cores loaded 5x)
    python benchmarks/quickstart.py --rounds 1   # the bounded run for a loaded machine: one quickstart of each
    python benchmarks/quickstart.py --quick          # 1 round of 2 steps, 4 eval blocks, no untimed first run,
                                                     # each variant forked from this process: a smoke test
    python benchmarks/quickstart.py --device cuda    # the default when a GPU is present (both variants)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.common import add_device_argument, load_note, machine_state, markdown_table, pick_device, write_results

REPO = Path(__file__).resolve().parents[1]


def peer(output_dir: str, steps: int, device: str, eval_blocks: int | None = None) -> None:
    """The quickstart on the plain transformers Trainer (same model, data, schedule, evaluations, checkpoints)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, default_data_collator, set_seed

    from hf_llmkit.data.blocks import build_lm_datasets
    from hf_llmkit.data.corpus import corpus_texts, corpus_tokenizer, default_cache_dir

    set_seed(42)
    tokenizer = corpus_tokenizer(vocab_size=4096)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    data = build_lm_datasets(
        tokenizer=tokenizer, block_size=128, texts=corpus_texts(), cache_dir=default_cache_dir() / "datasets", seed=42
    )
    args = TrainingArguments(
        output_dir, max_steps=steps, per_device_train_batch_size=8, per_device_eval_batch_size=16, learning_rate=1e-3,
        lr_scheduler_type="cosine", warmup_steps=20, weight_decay=0.01, logging_steps=20, save_steps=100,
        save_total_limit=2, report_to="none", disable_tqdm=True, seed=42, dataloader_pin_memory=False,
        use_cpu=device == "cpu",
    )  # fmt: skip
    validation = data["validation"]
    if eval_blocks is not None:  # as run_clm's --max_eval_samples
        validation = validation.select(range(min(eval_blocks, len(validation))))
    trainer = Trainer(
        model=model, args=args, train_dataset=data["train"], eval_dataset=validation,
        processing_class=tokenizer, data_collator=default_data_collator,
    )  # fmt: skip
    trainer.evaluate()
    outcome = trainer.train()
    trainer.save_model()
    trainer.save_metrics("train", outcome.metrics)
    trainer.evaluate()


RUN_CLM = "run_clm (make quickstart)"


def forked_variant(name: str, steps: int, device: str, eval_blocks: int | None, result: str) -> None:
    """`--quick`: the variant in this process (a child forked from the benchmark after it imported the stack once,
    `harness.slices.run_child`), its wall time and train_runtime written to `result` as `run_variant` returns them."""
    with tempfile.TemporaryDirectory(prefix="quickstart_") as out:
        start = time.perf_counter()
        if name == RUN_CLM:
            import run_clm

            argv = ["--output_dir", out, "--disable_tqdm", "true", "--max_steps", str(steps)]
            argv += ["--use_cpu", str(device == "cpu").lower(), "--max_eval_samples", str(eval_blocks)]
            run_clm.run(argv)
        else:
            peer(out, steps, device, eval_blocks)
        wall = time.perf_counter() - start
        train = json.loads((Path(out) / "train_results.json").read_text())
    Path(result).write_text(json.dumps({"wall_s": wall, "train_s": train["train_runtime"]}))


def run_forked(name: str, steps: int, device: str, eval_blocks: int | None) -> dict[str, float]:
    from harness import slices

    with tempfile.TemporaryDirectory(prefix="quickstart_child_") as work:
        got = slices.run_child(forked_variant, (name, steps, device, eval_blocks), Path(work) / "result.json",
                               name=name, timeout=3600)  # fmt: skip
    if "error" in got:
        raise RuntimeError(f"{name} failed: {got['error']}")
    return got


def run_variant(name: str, steps: int, device: str, eval_blocks: int | None = None) -> dict[str, float]:
    """One fresh process of `name` on `device`; its wall time and the Trainer's train_runtime (the Trainer
    synchronizes the GPU before it reads its clock)."""
    with tempfile.TemporaryDirectory(prefix="quickstart_") as out:
        if name == RUN_CLM:
            cmd = [
                sys.executable,
                str(REPO / "examples" / "run_clm.py"),
                "--output_dir",
                out,
                "--disable_tqdm",
                "true",
            ]
            cmd += ["--max_steps", str(steps), "--use_cpu", str(device == "cpu").lower()]
            cmd += ["--max_eval_samples", str(eval_blocks)] if eval_blocks else []
        else:
            cmd = [sys.executable, __file__, "--peer-run", out, "--steps", str(steps), "--device", device]
            cmd += ["--eval-blocks", str(eval_blocks)] if eval_blocks else []
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{proc.stderr[-4000:]}")
        train = json.loads((Path(out) / "train_results.json").read_text())
    return {"wall_s": wall, "train_s": train["train_runtime"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--peer-run", help=argparse.SUPPRESS)
    parser.add_argument("--eval-blocks", type=int, default=None, help="evaluate on this many validation blocks")
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 2 steps, 4 eval blocks, no untimed run, the variants forked from this "
                        "process (CPU)")  # fmt: skip
    add_device_argument(parser)
    options = parser.parse_args()
    device = pick_device(options.device).type
    if options.quick:
        options.rounds, options.steps, options.eval_blocks = 1, 2, 4
    if options.peer_run:
        return peer(options.peer_run, options.steps, device, options.eval_blocks)
    names = [RUN_CLM, "plain Trainer (peer)"]
    measure = run_variant
    if options.quick and device == "cpu":  # a smoke test of the whole script: the stack imported once, not per run
        sys.path.insert(0, str(REPO / "examples"))
        import run_clm  # noqa: F401

        measure = run_forked
    if not options.quick:  # untimed: builds the tokenizer and the data cache, as the first quickstart does
        run_variant(names[0], 1, device, options.eval_blocks)
    before = machine_state()
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for index in range(options.rounds):
        order = names[index % 2 :] + names[: index % 2]
        for name in order:
            samples[name].append(measure(name, options.steps, device, options.eval_blocks))
    after = machine_state()
    rows = [["variant", "wall s (min / median)", "train s (min / median)", "train x peer (min / median)"]]
    summary = {}
    for name in names:
        wall = [s["wall_s"] for s in samples[name]]
        train = [s["train_s"] for s in samples[name]]
        ratios = [a["train_s"] / b["train_s"] for a, b in zip(samples[name], samples[names[1]])]
        summary[name] = {"wall_s": wall, "train_s": train, "train_ratio_to_peer": ratios}
        rows.append([name, f"{min(wall):.1f} / {statistics.median(wall):.1f}",
                     f"{min(train):.1f} / {statistics.median(train):.1f}",
                     f"{min(ratios):.3f} / {statistics.median(ratios):.3f}"])  # fmt: skip
    print(f"## quickstart: {options.steps} steps, {options.rounds} rounds, {device}\n")
    print(markdown_table(rows) + "\n\n" + load_note(before, after))
    path = write_results("quickstart", {"steps": options.steps, "summary": summary, "before": before, "after": after})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
