"""The main job, examples/run_clm.py: trains on 1 and 2 ranks, resumes, rejects bad input in one line."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hf_llmkit.testing import launch_script, minilm_path
from tests.conftest import EXAMPLES
from tests.examples.test_seed_recipe import UNACTIONABLE

# A model and data small enough that a few steps take a second or two on 2 cores.
TINY = [
    "--vocab_size", "512", "--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "2",
    "--max_position_embeddings", "64", "--block_size", "32", "--per_device_train_batch_size", "4",
    "--per_device_eval_batch_size", "8", "--max_train_samples", "64", "--max_eval_samples", "16",
    "--logging_steps", "1", "--disable_tqdm", "true", "--warmup_steps", "0",
]  # fmt: skip


def test_trains_on_embedded_defaults(run_clm, tmp_path):
    results = run_clm.run([*TINY, "--output_dir", str(tmp_path), "--max_steps", "3"])
    assert results["global_step"] == 3
    assert results["eval_perplexity"] < results["eval_perplexity_before"]
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "eval_results.json").read_text())["eval_loss"] == pytest.approx(results["eval_loss"])


def test_resume_continues_from_checkpoint_step(run_clm, tmp_path):
    common = [*TINY, "--output_dir", str(tmp_path), "--save_steps", "2", "--save_total_limit", "3"]
    first = run_clm.run([*common, "--max_steps", "4"])
    assert first["global_step"] == 4 and (tmp_path / "checkpoint-4").is_dir()
    again = run_clm.run([*common, "--max_steps", "6"])  # the same command with a longer schedule
    assert again["resumed_at"] == 4
    assert again["global_step"] == 6
    state = json.loads((tmp_path / "checkpoint-6" / "trainer_state.json").read_text())
    logged_steps = [entry["step"] for entry in state["log_history"] if "loss" in entry]
    assert logged_steps == [1, 2, 3, 4, 5, 6]  # steps 5-6 follow 1-4 from the checkpoint's history


def test_overwrite_output_dir_starts_fresh(run_clm, tmp_path):
    common = [*TINY, "--output_dir", str(tmp_path), "--save_steps", "2", "--max_steps", "2"]
    run_clm.run(common)
    fresh = run_clm.run([*common, "--overwrite_output_dir", "true"])
    assert fresh["resumed_at"] == 0 and fresh["global_step"] == 2


def test_real_pretrained_model_folder(run_clm, tmp_path):
    """all-MiniLM-L6-v2 (real weights and WordPiece tokenizer) continues training as a causal LM."""
    model_dir = minilm_path()
    results = run_clm.run(
        ["--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path), "--max_steps", "2",
         "--block_size", "64", "--per_device_train_batch_size", "2", "--max_train_samples", "8",
         "--max_eval_samples", "4", "--learning_rate", "1e-4", "--disable_tqdm", "true"]
    )  # fmt: skip
    assert results["parameters"] > 20_000_000  # the real 22.7M-parameter model, not a from-scratch one
    assert results["global_step"] == 2
    saved = AutoTokenizer.from_pretrained(tmp_path)  # its own WordPiece tokenizer was used and saved
    assert len(saved) == len(AutoTokenizer.from_pretrained(model_dir)) == 30522


def test_two_ranks_with_accelerate_launch(tmp_path):
    out = launch_script(
        EXAMPLES / "run_clm.py",
        [*TINY, "--output_dir", str(tmp_path), "--max_steps", "3"],
        nprocs=2,
        launcher="accelerate",
        timeout=300,
    )
    assert "| ranks " in out.stdout and "| 2 " in out.stdout.split("| ranks")[1].splitlines()[0]
    assert [line for line in out.stdout.splitlines() if UNACTIONABLE.search(line)] == []  # no DDP / DeepSpeed noise
    assert sum(" INFO run_clm: blocks of" in line for line in out.stdout.splitlines()) == 1  # from rank 0 only
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert (tmp_path / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("flags", "model_type"),
    [
        (["--model_type", "qwen2", "--config_overrides", "tie_word_embeddings=true,rms_norm_eps=1e-5"], "qwen2"),
        (["--model_type", "mistral", "--config_overrides", "sliding_window=16"], "mistral"),
    ],
    ids=["qwen2-tied", "mistral"],
)
def test_model_type_and_config_overrides_build_any_causal_lm(run_clm, tmp_path, flags, model_type):
    """--model_type / --config_overrides: AutoConfig + AutoModelForCausalLM.from_config, as transformers' run_clm."""
    results = run_clm.run([*TINY, *flags, "--output_dir", str(tmp_path), "--max_steps", "2"])
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.model_type == model_type and config.hidden_size == 64 and results["global_step"] == 2
    if model_type == "qwen2":
        assert config.tie_word_embeddings and config.rms_norm_eps == 1e-5
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
        everything = sum(tensor.numel() for tensor in model.state_dict().values())
        assert results["parameters"] == results["trainable_parameters"] == everything - 512 * 64  # lm_head once


def test_help_lists_our_options_in_groups(run_clm, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "110")  # the width a pipe gets (a pytest worker may see its own terminal's)
    with pytest.raises(SystemExit) as done:
        run_clm.run(["--help"])
    text = capsys.readouterr().out
    titles = re.findall(r"^(\S[^:\n]*):$", text, flags=re.M)
    assert done.value.code == 0 and titles[:10] == [
        "model", "quantization", "DKM quantization", "data", "PEFT", "mixture of experts", "sequence parallel",
        "long sequences", "fault tolerance", "training",
    ]  # fmt: skip
    assert "--help-all" in text and "--model-name-or-path" not in text and "(default: dropless). (default" not in text
    assert len(text.splitlines()) < 290


def test_how_a_txt_file_is_cut_is_said_and_chosen(run_clm, tmp_path, monkeypatch, caplog):
    """Issue 46: `--validation_file held_out.txt` made each line of wrapped prose its own row with an end-of-text
    token, without a word. A run that does not train evaluates its model once."""
    import logging
    from pydoc_data.topics import topics

    from hf_llmkit.testing import corpus_tokenizer
    from hf_llmkit.trainers import LLMKitTrainer

    held = tmp_path / "held_out.txt"
    held.write_text(topics["if"] + "\n\n" + topics["while"], encoding="utf-8")  # wrapped prose, blank-line paragraphs
    lines = [line for line in held.read_text().splitlines() if line.strip()]
    paragraphs = held.read_text().count("\n\n") + 1
    seen = {}
    for rows in ("line", "paragraph"):
        real = LLMKitTrainer.evaluate
        calls = []

        def counting(self, *args, calls=calls, real=real, **kwargs):
            calls.append(self.eval_dataset)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(LLMKitTrainer, "evaluate", counting)
        flags = [*TINY, "--max_eval_samples", "1000", "--validation_file", str(held), "--text_rows", rows,
                 "--do_train", "false", "--output_dir", str(tmp_path / rows)]  # fmt: skip
        with caplog.at_level(logging.INFO, logger="run_clm"):
            results = run_clm.run(flags)
        assert len(calls) == 1 and "eval_perplexity_before" not in results  # untrained: evaluated once
        eos = corpus_tokenizer().eos_token_id  # the built-in model's
        seen[rows] = sum(block.count(eos) for block in calls[0]["input_ids"])
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("held_out.txt: ")]
    assert said[0].startswith("held_out.txt: each non-blank line is a row followed by the end-of-text token")
    assert "--text_rows paragraph" in said[0] and said[1].startswith("held_out.txt: each paragraph ")
    assert seen["line"] > seen["paragraph"] and seen["line"] <= len(lines) and seen["paragraph"] <= paragraphs
    with pytest.raises(run_clm.UsageError, match="^--text_rows cuts .txt files into rows, and the data has none; "):
        run_clm.run([*TINY, "--text_rows", "paragraph", "--output_dir", str(tmp_path / "none")])  # the embedded corpus


def test_merge_adapter_refuses_a_file_at_merged_before_any_work(run_clm, tmp_path):
    """Issue 52, the main job's side (the whole case is in test_run_sft.py): output_dir/merged a file is refused in
    one line before any work, not an exit 0 without the merged model."""
    (tmp_path / "merged").write_text("notes")
    with pytest.raises(run_clm.UsageError, match="and that is a file: remove it, or pass another --output_dir"):
        run_clm.run([*TINY, "--output_dir", str(tmp_path), "--peft_method", "lora", "--merge_adapter", "true"])
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]
