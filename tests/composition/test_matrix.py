"""Every feature composes with every other (issue 12 section 2): each cell of `matrix.CELLS` trains a few real
`LLMKitTrainer` steps on real gloo ranks, its loss is finite and falls, its saved model reloads in a fresh model
with the trained model's outputs, and it matches its single-rank equivalent within 1e-5 (losses and outputs).
A pair that cannot work is refused before any work with a one-line ValueError.

The cells on the same number of ranks run in one launch (one process group serves them all, DeepSpeed and FSDP2
cells included; starting ranks dominates the cost on CPU), and cells with the same single-rank equivalent share one
reference run; see `matrix.py` for the table and `readme_table.py` for the README section generated from it.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.composition.cells import build_model, reference, reload, run_cells
from tests.composition.matrix import CELLS, Cell, Setup
from tests.warm import launch

TOLERANCE = 1e-5


@functools.cache
def shared_reference(single: Setup, base_dir: str) -> tuple[list[float], torch.Tensor]:
    """`reference` of a single-rank setup, run once per test process (e.g. LoRA x ZeRO-2, ZeRO-3, FSDP2, sequence
    parallel 2 and gradient checkpointing all replay plain LoRA)."""
    return reference(single, base_dir)


def split_autocast(setup) -> bool:
    """Whether the cell splits each batch over ranks under autocast (sequence parallelism in bf16 / fp16)."""
    return bool(setup.autocast_dtype) and setup.sp > 1


def tolerances(setup, base_dir: str, ref_losses: list[float], ref_logits: torch.Tensor) -> tuple[float, float]:
    """How close a cell's losses and outputs must come to its single-rank equivalent's.

    1e-5 (float32 reduction order) for every cell that computes what its reference computes: fp32 cells and
    single-rank autocast cells (bitwise equal here). A cell that splits each batch over ranks under autocast
    produces every weight gradient of the autocast dtype as several rounded partial products (one per rank's
    tokens) instead of one, so each gradient element may differ by a rounding of that dtype every step -- the kind of
    error autocast itself makes against fp32. Such a cell must then be no further from the single-rank autocast run
    than that run is from the same training in fp32 (measured here); a lost or double-counted shard moves it
    much further.
    """
    if not split_autocast(setup):
        return TOLERANCE, TOLERANCE
    fp32_losses, fp32_logits = shared_reference(replace(setup, precision="").single_rank(), base_dir)
    loss_tol = max(abs(a - b) for a, b in zip(ref_losses, fp32_losses))
    return max(TOLERANCE, loss_tol), max(TOLERANCE, (ref_logits - fp32_logits).abs().max().item())


def _group(c: Cell) -> int:
    """Cells launched together: every cell on the same number of ranks (one process group serves them all, DeepSpeed
    cells included: `run_cells` gives each cell a fresh Trainer state)."""
    return c.setup.ranks


class MatrixRuns:
    """Launches a group of cells the first time one of its cells asks for its result."""

    def __init__(self, workdir: Path, base_dir: Path, selected: set[str]):
        self.workdir, self.base_dir, self.selected = workdir, base_dir, selected
        self.results: dict[str, dict] = {}

    def result(self, c: Cell) -> dict:
        if c.name not in self.results:  # the group's cells this session runs (all of them, or those `-k` picked)
            group = [o for o in CELLS if o.name in self.selected and _group(o) == _group(c) and o.expected == "ok"]
            names = [o.name for o in group]
            ranks = launch(
                run_cells, names, str(self.workdir), str(self.base_dir), nprocs=c.setup.ranks,
                timeout=120 + 60 * len(names), init_process_group=c.setup.ranks > 1,
            )  # fmt: skip
            self.results.update(ranks[0])
        return self.results[c.name]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """The tiny Llama saved as a pretrained folder (what the bitsandbytes cells load in 4 bits)."""
    from hf_llmkit.testing import tiny_llama

    folder = tmp_path_factory.mktemp("composition_base")
    tiny_llama(seed=0).save_pretrained(folder / "tiny")
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base_dir, request) -> MatrixRuns:
    selected = {
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "name" in item.callspec.params
    }
    return MatrixRuns(tmp_path_factory.mktemp("composition"), base_dir, selected)


def _param(c: Cell):
    marks = [pytest.mark.slow] if c.slow else []
    if c.expected.startswith("known bug"):
        marks.append(pytest.mark.xfail(reason=c.expected, run=False))
    return pytest.param(c.name, id=c.name, marks=marks)


def _should_work(c: Cell) -> bool:
    return c.expected == "ok" or c.expected.startswith("known bug")


@pytest.mark.parametrize("name", [_param(c) for c in CELLS if _should_work(c)])
def test_pair_trains_saves_reloads_and_matches_single_rank(name, runs, base_dir):
    c = next(o for o in CELLS if o.name == name)
    result = runs.result(c)
    assert "error" not in result, result["error"]
    losses = result["losses"]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
    assert result["drift"] == 0.0, f"replicated weights differ between ranks by {result['drift']}"
    if c.setup.fsdp:
        assert result["sharded"], "FSDP2 did not shard the parameters (accelerate ran DDP instead)"
    if c.setup.precision == "fp16":
        assert result["scale"] is not None, "fp16 trained without a GradScaler"
    ref_losses, ref_logits = shared_reference(c.setup.single_rank(), str(base_dir))
    loss_tol, logits_tol = tolerances(c.setup, str(base_dir), ref_losses, ref_logits)
    if loss_tol > TOLERANCE:  # how much of the allowance a split autocast cell uses (`pytest -s` shows it)
        print(f"{name}: losses within {max(abs(a - b) for a, b in zip(losses, ref_losses)):.2e} of {loss_tol:.2e}")
    assert losses == pytest.approx(ref_losses, abs=loss_tol), "the losses differ from the single-rank equivalent"
    reloaded = reload(c.setup, str(base_dir), result["saved"])
    if logits_tol > TOLERANCE:
        print(f"{name}: outputs within {(reloaded - ref_logits).abs().max().item():.2e} of {logits_tol:.2e}")
    if result["logits"] is not None:
        torch.testing.assert_close(reloaded, result["logits"], atol=TOLERANCE, rtol=0, msg="reload changed outputs")
    torch.testing.assert_close(
        reloaded, ref_logits, atol=logits_tol, rtol=0, msg="the outputs differ from the single-rank equivalent"
    )


@pytest.mark.parametrize("name", [c.name for c in CELLS if not _should_work(c)])
def test_pair_that_cannot_work_is_refused_before_any_work(name, base_dir):
    c = next(o for o in CELLS if o.name == name)
    with pytest.raises(ValueError, match=re.escape(c.match)) as err:
        build_model(c.setup, str(base_dir))
    assert "\n" not in str(err.value), "the refusal must be one line"
