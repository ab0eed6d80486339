"""examples/run_clm.py --quantization dkm: QAT in the main job, a packed checkpoint, bad options in one line."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_llmkit.cli.results import describe_setup, results_table
from hf_llmkit.data.blocks import build_lm_datasets
from hf_llmkit.data.corpus import corpus_texts
from hf_llmkit.quantization import PalettizedEmbedding, PalettizedLinear
from hf_llmkit.quantization.tied import TiedDKMHead
from tests.examples.test_run_clm import TINY


def test_run_clm_trains_with_dkm_and_saves_packed(run_clm, tmp_path):
    args = [*TINY, "--output_dir", str(tmp_path), "--max_steps", "2", "--torch_dtype", "bfloat16"]
    results = run_clm.run([*args, "--quantization", "dkm", "--dkm_bits", "4", "--save_steps", "100"])
    assert results["global_step"] == 2
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        packed = f.get_tensor("model.layers.0.mlp.up_proj.weight_packed")
    assert packed.dtype == torch.uint8 and packed.numel() == 128 * 64 * 4 // 8
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(model.model.layers[0].mlp.up_proj, PalettizedLinear)


def test_run_clm_rejects_bad_dkm_options(run_clm, tmp_path):
    with pytest.raises(run_clm.UsageError, match="bits must be an integer from 1 to 8"):
        run_clm.run([*TINY, "--output_dir", str(tmp_path), "--quantization", "dkm", "--dkm_bits", "9"])


def test_run_clm_calibrates_once_and_saves_what_one_call_gives(run_clm, tmp_path, monkeypatch, caplog):
    """--dkm_calibration_samples: the job ends with exactly one `calibrate` (no duplicate callback, no transformers
    warning), and the saved model is what one call gives: the same call replayed on a copy of the trained model
    saves the same tensors bit for bit."""
    import copy
    import logging

    from safetensors.torch import load_file

    from hf_llmkit.quantization import calibrate, training_state

    calls = []

    def counting(model, batches):
        batches = list(batches)
        calls.append((copy.deepcopy(model), batches))
        return calibrate(model, batches)

    monkeypatch.setattr(training_state, "calibrate", counting)
    args = [*TINY, "--output_dir", str(tmp_path / "job"), "--max_steps", "2", "--save_strategy", "no"]
    with caplog.at_level(logging.WARNING):
        run_clm.run([*args, "--quantization", "dkm", "--dkm_bits", "3", "--dkm_calibration_samples", "4"])
    assert "already one" not in caplog.text
    assert len(calls) == 1
    trained, batches = calls[0]
    calibrate(trained, batches)
    trained.save_pretrained(tmp_path / "replayed")
    saved, replayed = (load_file(tmp_path / d / "model.safetensors") for d in ("job", "replayed"))
    assert saved.keys() == replayed.keys() and any(k.endswith("weight_packed") for k in saved)
    assert all(torch.equal(saved[k], replayed[k]) for k in saved)


SHORT = [*TINY, "--max_steps", "2", "--save_strategy", "no", "--max_train_samples", "16", "--max_eval_samples", "8"]


def test_a_compact_checkpoint_as_the_model_continues_its_dkm_training(run_clm, tmp_path):
    """Issue 46: a compact DKM checkpoint as --model_name_or_path trained with every packed layer frozen (only
    embeddings, norms and the head changed) under a results table saying "full fine-tuning" or "DKM 3-bit"."""
    from safetensors.torch import load_file

    start = tmp_path / "start"
    saving = ["--save_strategy", "steps", "--save_steps", "2"]  # its checkpoint-2 holds the DKM training state
    run_clm.run([*SHORT, *saving, "--output_dir", str(start), "--quantization", "dkm", "--dkm_bits", "4"])
    again = [*SHORT[10:], "--model_name_or_path", str(start), "--output_dir", str(tmp_path / "again")]
    with pytest.raises(
        run_clm.UsageError, match=r"is a compact DKM checkpoint \(4-bit packed layers, which train only "
    ):
        run_clm.run(again)
    with pytest.raises(
        run_clm.UsageError, match=r"^--dkm_bits 3: --model_name_or_path .* with bits=4 .*; drop --dkm_bits$"
    ):
        run_clm.run([*again, "--quantization", "dkm", "--dkm_bits", "3"])
    results = run_clm.run([*again, "--quantization", "dkm", "--learning_rate", "0.05"])
    assert results["trainable_parameters"] == results["parameters"]  # the clustered layers train too
    before, after = (load_file(d / "model.safetensors") for d in (start, tmp_path / "again"))
    packed = [k for k in before if k.endswith("weight_packed")]
    assert packed and all(before[k].shape == after[k].shape for k in packed)  # still 4-bit
    assert sum(not torch.equal(before[k], after[k]) for k in packed) == len(packed)  # every clustered layer moved
    trainer_checkpoint = [
        *again[:-1],
        str(tmp_path / "from-checkpoint"),
        "--model_name_or_path",
        str(start / "checkpoint-2"),
    ]
    assert run_clm.run([*trainer_checkpoint, "--quantization", "dkm"])["global_step"] == 2  # loads trainable already
    described = dict(describe_setup(run_clm.parse_args([*again, "--quantization", "dkm"])))  # the results table
    assert described["quantization"] == f"DKM 4-bit (per_tensor), continued from the compact checkpoint {start}"


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--dkm_calibration_samples", "0"], "--dkm_recipe calibrated replaces --dkm_calibration_samples 0 with 128:"),
        (["--dkm_lut_dtype", "float32"], "--dkm_recipe calibrated replaces --dkm_lut_dtype float32 with float16:"),
        (["--dkm_scale_block_size", "0"], "--dkm_recipe calibrated replaces --dkm_scale_block_size 0 with 64:"),
        (["--dkm_bits", "4", "--dkm_latent_lr_scale", "1.0"], "replaces --dkm_latent_lr_scale 1.0 with 0.1:"),
    ],
    ids=["samples", "lut-dtype", "scales", "latent-lr"],
)
def test_the_recipe_refuses_a_flag_typed_at_the_default_it_would_replace(run_clm, tmp_path, flags, line):
    """Issue 46: `--dkm_recipe calibrated` replaced explicit `--dkm_calibration_samples 0 --dkm_lut_dtype float32
    --dkm_scale_block_size 0` with 128, float16 and 64 without a word."""
    with pytest.raises(run_clm.UsageError) as error:
        run_clm.parse_args([*SHORT, "--quantization", "dkm", "--dkm_recipe", "calibrated", *flags])
    assert line in str(error.value) and "\n" not in str(error.value)
    kept = run_clm.parse_args(
        [*SHORT, "--quantization", "dkm", "--dkm_recipe", "calibrated", "--dkm_lut_dtype", "float16"]
    )
    assert kept.dkm.build_config().lut_dtype == "float16"  # the recipe's own value, typed: fine


def test_the_recipes_calibration_is_said_timed_evaluated_and_reported(run_clm, tmp_path, monkeypatch, caplog):
    """Issue 46, on the real model: the recipe's calibration ran inside the first step with no log line under a
    progress bar whose remaining time counted it, "eval perplexity before" was the k-means start training never uses,
    and neither the results table nor train_results.json named the recipe or its calibration."""
    import json
    import logging

    from transformers.trainer_callback import ProgressCallback

    from hf_llmkit.quantization import training_state
    from hf_llmkit.trainers import LLMKitTrainer

    order = []
    real_calibrate, real_evaluate, real_bar = (
        training_state.calibrate,
        LLMKitTrainer.evaluate,
        ProgressCallback.on_train_begin,
    )
    monkeypatch.setattr(
        training_state, "calibrate", lambda *a, **k: order.append("calibrate") or real_calibrate(*a, **k)
    )
    monkeypatch.setattr(LLMKitTrainer, "evaluate", lambda *a, **k: order.append("evaluate") or real_evaluate(*a, **k))
    monkeypatch.setattr(ProgressCallback, "on_train_begin", lambda *a, **k: order.append("bar") or real_bar(*a, **k))
    flags = [*SHORT, "--output_dir", str(tmp_path), "--quantization", "dkm", "--dkm_recipe", "calibrated",
             "--dkm_scale_block_size", "16", "--dkm_calibration_samples", "8", "--disable_tqdm", "false"]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="hf_llmkit"):
        results = run_clm.run(flags)
    assert order == ["calibrate", "evaluate", "bar", "evaluate"]  # the start evaluated; the bar starts after
    lines = [r.getMessage() for r in caplog.records if r.name == "hf_llmkit.cli.calibrated_start"]
    assert lines[0].startswith("calibrating the DKM start on 8 training examples before the first step")
    assert lines[1].startswith("calibrated the DKM start in ")
    assert results["eval_before"] == "the calibrated start"
    saved = json.loads((tmp_path / "train_results.json").read_text())
    assert (saved["dkm_calibration_samples"], saved["dkm_recipe"]) == (8, "calibrated")
    table = dict(describe_setup(run_clm.parse_args(flags)))
    assert table["quantization"] == "DKM 3-bit (per_tensor), recipe calibrated"
    text = results_table([], {**results, "parameters": 1, "trainable_parameters": 1})
    assert "| DKM calibration" in text and "8 training examples, before the first step" in text
    assert "| eval perplexity before (the calibrated start) |" in text


def test_the_recipe_without_training_evaluates_its_calibrated_start(run_clm, tmp_path):
    """Found attacking issue 46: `--dkm_recipe calibrated --do_train false` evaluated the k-means start (the recipe
    calibrates when training begins) under a table naming the recipe; it is the post-training result asked for."""
    recipe = [*SHORT, "--quantization", "dkm", "--dkm_recipe", "calibrated", "--dkm_scale_block_size", "16",
              "--dkm_calibration_samples", "8"]  # fmt: skip
    trained = run_clm.run([*recipe, "--output_dir", str(tmp_path / "trained")])
    untrained = run_clm.run([*recipe, "--output_dir", str(tmp_path / "untrained"), "--do_train", "false"])
    assert untrained["eval_loss"] == pytest.approx(trained["eval_loss_before"], abs=1e-6)  # the calibrated start
    assert untrained["dkm_calibration_samples"] == 8
    assert "8 training examples, before the evaluation (no training)" in results_table([], untrained)


TIED_CLUSTERED = ["--config_overrides", "tie_word_embeddings=true", "--quantization", "dkm", "--dkm_bits", "4",
                  "--dkm_quantize_embeddings", "true"]  # fmt: skip


def test_a_head_tied_to_its_clustered_embedding_trains_saves_and_reloads_as_evaluated(run_clm, tmp_path):
    """--dkm_quantize_embeddings true on a tied model (issue 52): the LM head is the clustered embedding through
    the job, the packed save and the reload, whose loss on the held-out blocks is the run's eval_loss; the same
    again when a second run continues the DKM training of that compact checkpoint (the head follows the embedding
    made trainable)."""
    held = tmp_path / "held_out.txt"
    held.write_text("\n".join(corpus_texts()[-12:]), encoding="utf-8")
    texts = held.read_text(encoding="utf-8").splitlines()  # the lines the job reads
    flags = ["--max_steps", "2", "--max_eval_samples", "8", "--validation_file", str(held), "--save_strategy", "no",
             "--learning_rate", "1e-2"]  # fmt: skip
    first = run_clm.run([*TINY, *flags, *TIED_CLUSTERED, "--output_dir", str(tmp_path / "first")])
    again = ["--model_name_or_path", str(tmp_path / "first"), "--quantization", "dkm"]
    second = run_clm.run([*TINY[10:], *flags, *again, "--output_dir", str(tmp_path / "second")])
    assert second["eval_loss"] != first["eval_loss"]  # it trained on
    for out, results in ((tmp_path / "first", first), (tmp_path / "second", second)):
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        assert isinstance(model.model.embed_tokens, PalettizedEmbedding) and isinstance(model.lm_head, TiedDKMHead)
        assert model.lm_head.embedding is model.model.embed_tokens
        tokenizer = AutoTokenizer.from_pretrained(out)
        blocks = build_lm_datasets(tokenizer=tokenizer, block_size=32, texts=texts, validation_texts=texts)
        ids = torch.tensor(blocks["validation"]["input_ids"][:8])  # one evaluation batch: the Trainer's loss
        with torch.no_grad():
            assert model(input_ids=ids, labels=ids).loss.item() == pytest.approx(results["eval_loss"], abs=1e-5)
