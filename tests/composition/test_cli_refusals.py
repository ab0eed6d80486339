"""Every pair the library refuses with a `ValueError` ends, through the main jobs, in their one-line `error:` format
with exit status 2 before any work (issue 33): the composition matrix's refused pairs (`REFUSED`), walked through
`examples/run_clm.py` as a user would type them, and the pairs found refused only once the model or the trainer was
built."""

from __future__ import annotations

import pytest
import torch

from hf_llmkit.cli import USAGE_EXIT_CODE, job
from tests.composition.matrix import CELLS, PEFT_METHODS, REFUSED, Setup

# How a user switches on each feature of a matrix `Setup` with the main jobs' flags.
FLAGS = {
    "peft": lambda method: ["--peft_method", method],
    "moe": lambda on: ["--upcycle_moe", "true", "--moe_num_experts", "4", "--moe_top_k", "2"],
    "dkm": lambda on: ["--quantization", "dkm", "--dkm_bits", "3"],
    "bnb4": lambda on: ["--load_in_kbits", "4", "--model_name_or_path", "a-pretrained-model"],
    "gc": lambda on: ["--gradient_checkpointing", "true"],
}
TINY = ["--vocab_size", "512", "--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "2"]


def command(setup: Setup) -> list[str]:
    """The flags that build `setup`; a feature the mapping does not know fails the test (add it to FLAGS)."""
    argv = []
    for name, default in vars(Setup()).items():
        value = getattr(setup, name)
        if value == default:
            continue
        assert name in FLAGS, f"a refused cell uses {name}: add how a user switches it on to FLAGS"
        argv += FLAGS[name](value)
    if setup.bnb4 and setup.peft is None:  # a 4-bit base trains an adapter (refused without one, for that reason)
        argv += FLAGS["peft"](PEFT_METHODS[0])
    return argv


def _refused(run_clm, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        sizes = [] if "--model_name_or_path" in argv else TINY  # a pretrained model brings its own
        job.main(lambda: run_clm.run([*sizes, "--max_steps", "1", *argv]), prog="run_clm.py")
    assert info.value.code == USAGE_EXIT_CODE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run_clm.py: error: "), lines
    return lines[0]


REFUSED_CELLS = [cell for cell in CELLS if (cell.feature, cell.partner) in REFUSED]


def test_the_matrix_has_refused_pairs_to_walk():
    assert REFUSED_CELLS and {(c.feature, c.partner) for c in REFUSED_CELLS} == set(REFUSED)


@pytest.mark.parametrize("cell", REFUSED_CELLS, ids=lambda c: c.name)
def test_every_refused_pair_of_the_matrix_stops_the_main_job_in_one_line(run_clm, cell, capsys, tmp_path):
    line = _refused(run_clm, [*command(cell.setup), "--output_dir", str(tmp_path / "out")], capsys)
    assert not (tmp_path / "out").exists()  # before any work: no output folder
    named = {"dkm": "--quantization dkm", "moe": "--upcycle_moe", "bnb4": "--load_in_kbits"}
    assert all(named[f] in line for f in (cell.feature, cell.partner) if f in named), line


@pytest.mark.parametrize(
    "argv, named",
    [
        (
            ["--upcycle_moe", "true", "--moe_capacity_factor", "1.0", "--tiled_mlp", "true"],
            "--tiled_mlp cannot tile experts with --moe_capacity_factor",
        ),
        (["--tiled_loss", "true", "--label_smoothing_factor", "0.1"], "drop --label_smoothing_factor or"),
        (["--num_attention_heads", "2", "--num_key_value_heads", "3"], "--num_key_value_heads 3 does not divide"),
        (["--config_overrides", "num_key_value_heads=3"], "--num_key_value_heads 3 does not divide"),
        (["--enable_jit_checkpoint", "true"], "drop --enable_jit_checkpoint (fault tolerance saves"),
    ],
    ids=[
        "moe_capacity-x-tiled_mlp",
        "tiled_loss-x-label_smoothing",
        "kv_heads-x-heads",
        "kv_heads-override",
        "jit_checkpoint-x-fault_tolerance",
    ],  # fmt: skip
)
def test_pairs_refused_once_built_stop_before_any_work(run_clm, argv, named, capsys, tmp_path):
    line = _refused(run_clm, [*argv, "--output_dir", str(tmp_path / "out")], capsys)
    assert named in line and not (tmp_path / "out").exists()


def test_fp16_without_a_gpu_stops_in_one_line(run_clm, capsys, tmp_path):
    """On CPU accelerate makes neither fp16 autocast nor a GradScaler: `--fp16 true` would train in fp32."""
    if torch.accelerator.is_available():  # not current_accelerator(): a CUDA build names cuda without a GPU
        pytest.skip("an accelerator runs fp16 (tests/examples/test_run_clm_output.py, marked gpu)")
    line = _refused(run_clm, ["--fp16", "true", "--output_dir", str(tmp_path / "out")], capsys)
    assert "--fp16 true needs a GPU" in line and not (tmp_path / "out").exists()


def test_the_jit_checkpoint_alone_runs_as_the_refusal_says(run_clm, tmp_path):
    """The second fix the `--enable_jit_checkpoint` refusal names: `--fault_tolerance false` leaves SIGTERM to it."""
    argv = [*TINY, "--max_steps", "1", "--do_eval", "false", "--output_dir", str(tmp_path)]
    results = run_clm.run([*argv, "--enable_jit_checkpoint", "true", "--fault_tolerance", "false"])
    assert results["global_step"] == 1
