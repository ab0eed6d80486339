"""What a run of examples/run_clm.py prints and writes: a quiet console, HF's results files, TensorBoard metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_llmkit.data.corpus import corpus_texts
from tests import warm
from tests.conftest import EXAMPLES
from tests.examples.test_run_clm import TINY
from tests.examples.test_seed_recipe import UNACTIONABLE


def _scalars(logdir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = {p.parent for p in logdir.rglob("events.out.tfevents.*")}
    assert len(runs) == 1, f"event files under {logdir}: {runs}"
    events = EventAccumulator(str(runs.pop()))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_quiet_run_writes_results_files_and_our_metrics_to_tensorboard(tmp_path):
    held = tmp_path / "held_out.txt"
    held.write_text("\n".join(corpus_texts()[-6:]), encoding="utf-8")
    out = tmp_path / "out"
    flags = [*TINY, "--max_steps", "3", "--upcycle_moe", "true", "--moe_num_experts", "4", "--report_to",
             "tensorboard", "--validation_file", str(held), "--output_dir", str(out)]  # fmt: skip
    flags.remove("--max_eval_samples")
    flags.remove(TINY[TINY.index("--max_eval_samples") + 1])
    # `python run_clm.py ...` forked from the warm interpreter (tests/warm.py): everything the run prints is its own;
    # what importing the stack prints is the cold test_run_pt_sh_runs_the_seed_recipe_on_two_ranks_quietly's to check
    proc = warm.run_script(EXAMPLES / "run_clm.py", flags, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    noise = [line for line in proc.stderr.splitlines() if UNACTIONABLE.search(line)]
    assert noise == [], noise  # nothing a user cannot act on
    assert "| mixture of experts     | 4 experts, top-2 (upcycled)" in proc.stdout
    train, evaluation, combined = (json.loads((out / f"{name}_results.json").read_text()) for name in
                                   ("train", "eval", "all"))  # fmt: skip
    assert train["train_samples"] == 64 and "train_loss" in train
    assert evaluation["perplexity"] == pytest.approx(torch.tensor(evaluation["eval_loss"]).exp().item(), rel=1e-5)
    assert combined == {**train, **evaluation}
    blocks = json.loads((out / "trainer_state.json").read_text())
    assert blocks["global_step"] == 3
    # every held-out block was evaluated, and only those: the split of the training data is not used
    from transformers import AutoTokenizer

    tokens = sum(
        len(AutoTokenizer.from_pretrained(out)(line)["input_ids"]) + 1 for line in held.read_text().split("\n")
    )
    assert evaluation["eval_samples"] == tokens // 32
    scalars = _scalars(out / "runs")
    for tag in ("train/loss", "train/moe_load_max_min_ratio", "train/moe_aux_loss", "train/moe_load_e0", "eval/loss"):
        assert tag in scalars and len(scalars[tag]) >= 1, sorted(scalars)
    assert len(scalars["train/moe_load_max_min_ratio"]) == 3  # one per logging step, next to the loss
    assert not (tmp_path / "runs").exists()  # all of it in output_dir/runs, nothing in the current folder


@pytest.mark.gpu
def test_fp16_loss_scale_reaches_tensorboard(run_clm, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("the fp16 loss scale needs a CUDA GradScaler")
    run_clm.run(
        [*TINY, "--max_steps", "3", "--fp16", "true", "--report_to", "tensorboard", "--output_dir", str(tmp_path)]
    )
    scalars = _scalars(tmp_path / "runs")
    assert "train/loss_scale" in scalars and len(scalars["train/loss_scale"]) == 3
