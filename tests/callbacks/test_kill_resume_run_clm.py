"""The main job survives kill -9 and preemption: `examples/run_clm.py` SIGKILLed (or SIGTERMed) after its first
checkpoint and re-run with the same command ends with every final artifact (model, adapter, tokenizer)
byte-identical to an uninterrupted run, for every training method it offers (issue 11, sections 2 and 3).

Every case the session runs is run by one harness job (a child of the warm interpreter, tests/warm.py: no import of
its own), which runs one uninterrupted reference per command (the SIGKILL and SIGTERM cases of full fine-tuning share
theirs). Full fine-tuning, LoRA, bottleneck and the SIGTERM case are in `make test`; the other methods are `slow`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import warm
from tests.callbacks.clm_kill_harness import run_cases

# The tiny settings of tests/examples, 4 steps with a checkpoint every 2 (the kill lands after checkpoint-2, the
# resumed run trains the last two and saves checkpoint-4); one evaluation batch.
TINY = [
    "--vocab_size", "512", "--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "2",
    "--max_position_embeddings", "64", "--block_size", "32", "--per_device_train_batch_size", "4",
    "--per_device_eval_batch_size", "8", "--max_train_samples", "64", "--max_eval_samples", "8",
    "--logging_steps", "1", "--disable_tqdm", "true", "--warmup_steps", "0", "--max_steps", "4", "--save_steps", "2",
]  # fmt: skip
QUICK = {
    "full": {"flags": []},
    "lora": {"flags": ["--peft_method", "lora", "--lora_rank", "4"]},
    "bottleneck": {"flags": ["--peft_method", "bottleneck", "--bottleneck_size", "8"]},
    "full-sigterm": {"flags": [], "signal": "SIGTERM"},
}
SLOW = {
    "bitfit": {"flags": ["--peft_method", "bitfit"]},
    "ptuning": {
        "flags": [
            "--peft_method",
            "ptuning",
            "--num_virtual_tokens",
            "3",
            "--ptuning_template",
            "[P0][P1] {text} [P2]",
        ]
    },
    "ptuning_v2": {
        "flags": ["--peft_method", "ptuning_v2", "--num_virtual_tokens", "4", "--prefix_projection", "true"]
    },
    "dkm": {"flags": ["--quantization", "dkm", "--dkm_bits", "3"]},
    # issue 52: the straight-through forward decoded stale weights after fused AdamW steps, a resume fresh ones
    "dkm-calibrated": {
        "flags": [
            "--quantization",
            "dkm",
            "--dkm_bits",
            "3",
            "--dkm_recipe",
            "calibrated",
            "--dkm_calibration_samples",
            "8",
        ]
    },
    "moe": {"flags": ["--upcycle_moe", "true", "--moe_num_experts", "4", "--moe_top_k", "2"]},
    "sequence_parallel_2_ranks": {"flags": ["--sequence_parallel_size", "2"], "ranks": 2},
}


def _harness(workdir: Path, cases: dict, *, example: str = "run_clm", tiny: list[str] = TINY) -> dict:
    """`clm_kill_harness.run_cases` for `cases` (their flags after `tiny`) in a child of the warm interpreter."""
    cases = {name: {**case, "flags": [*tiny, *case["flags"]]} for name, case in cases.items()}
    return warm.call(run_cases, str(workdir), cases, example, timeout=300 + 150 * len(cases))


@pytest.fixture(scope="module")
def harness(request, tmp_path_factory) -> tuple[Path, dict]:
    """Every case the session runs a test of, in one harness job (a slow cell alone runs only its own case)."""
    names = {
        item.callspec.params["name"] if hasattr(item, "callspec") else "full-sigterm"
        for item in request.session.items
        if item.module is request.module
    }
    workdir = tmp_path_factory.mktemp("clm_kill")
    cases = {name: case for name, case in {**QUICK, **SLOW}.items() if name in names}
    return workdir, _harness(workdir, cases)


def _check_same_final_artifacts(name: str, case: dict, result: dict, workdir: Path) -> None:
    ranks = case.get("ranks", 1)
    assert result["reference_exit"] == [0] * ranks, result
    assert result["signalled"] and result["interrupted_after"] == "checkpoint-2", result  # stopped after a save
    assert result["resumed_exit"] == [0] * ranks, result
    comparison = result["comparison"]
    weights = [file for file in comparison["files"] if file.endswith(".safetensors")]
    assert weights and any(file.startswith("tokenizer") for file in comparison["files"]), comparison
    assert comparison["missing"] == [] and comparison["extra"] == [], comparison
    assert comparison["differing"] == {}, comparison
    if "--peft_method" in case["flags"]:  # the final adapter is the final one, not a nested copy of a checkpoint's
        assert "adapter/adapter_model.safetensors" in comparison["files"]
        assert not (workdir / name / "resumed" / "adapter" / "adapter").exists()


@pytest.mark.parametrize(
    "name",
    [*(n for n in QUICK if n != "full-sigterm")] + [pytest.param(n, marks=pytest.mark.slow) for n in SLOW],
)
def test_killed_run_resumes_to_the_same_final_artifacts(name, harness):
    workdir, results = harness
    _check_same_final_artifacts(name, {**QUICK, **SLOW}[name], results[name], workdir)


def test_sigterm_saves_exits_143_with_one_line_and_the_same_command_finishes_the_same(harness):
    workdir, results = harness
    result = results["full-sigterm"]
    assert result["interrupted_exit"] == [143] and result["interrupted_tracebacks"] == 0, result
    [line] = result["interrupted_stop_lines"]
    assert "received SIGTERM" in line and "run the same command again to continue" in line, line
    assert line.endswith("(exit status 143)")
    saved = line.split("saving the complete checkpoint ")[1].split(";")[0]
    assert Path(saved).name in result["left_after_interruption"]
    assert "model.safetensors" not in result["left_after_interruption"]  # a preempted run writes no final model
    assert any(saved in row for row in result["resumed_from"]), result["resumed_from"]
    _check_same_final_artifacts("full-sigterm", QUICK["full-sigterm"], result, workdir)


def test_a_run_distilled_from_its_source_resumes_to_the_same_final_artifacts(tmp_path):
    """Issue 51: `--distill_from_source true`; the resumed run loads the source again, and its targets are the same
    (no evaluation: the cheapest case that checks it)."""
    from hf_llmkit.testing import corpus_tokenizer, tiny_llama

    source = tmp_path / "source"
    tiny_llama().save_pretrained(source)
    corpus_tokenizer(vocab_size=512).save_pretrained(source)
    pretrained = ["--model_name_or_path", str(source), *TINY[TINY.index("--block_size") :]]
    flags = ["--quantization", "dkm", "--dkm_bits", "3", "--distill_from_source", "true", "--do_eval", "false"]
    case = {"flags": [*flags, "--max_train_samples", "16"]}
    result = _harness(tmp_path / "work", {"distill": case}, tiny=pretrained)["distill"]
    _check_same_final_artifacts("distill", {"flags": [*pretrained, *case["flags"]]}, result, tmp_path / "work")
