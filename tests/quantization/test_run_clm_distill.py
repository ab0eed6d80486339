"""`--distill_from_source true` (issue 51): the main jobs train a DKM model on KL(source || model), the source being
the model as loaded before quantization; what cannot distil is refused in one line before any work."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers import default_data_collator as collate

from hf_llmkit.cli import job
from hf_llmkit.cli.model_loading import load_tokenizer
from hf_llmkit.quantization import keep_training_state
from hf_llmkit.testing import corpus_tokenizer, tiny_llama
from hf_llmkit.trainers import ResumeError
from tests.one_launch import fresh_trainer_state

SHORT = ["--block_size", "32", "--per_device_train_batch_size", "4", "--max_train_samples", "16",
         "--max_eval_samples", "4", "--logging_steps", "1", "--disable_tqdm", "true", "--warmup_steps", "0",
         "--report_to", "none"]  # fmt: skip
DISTIL = ["--quantization", "dkm", "--distill_from_source", "true"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A small pretrained Llama folder (model + tokenizer): the source the runs compress."""
    folder = tmp_path_factory.mktemp("distill") / "source"
    tiny_llama().save_pretrained(folder)
    corpus_tokenizer(vocab_size=512).save_pretrained(folder)
    return folder


def _independent_kl(source, model, batch) -> torch.Tensor:
    """KL(source || model) per scored position, computed here from a fresh load of the source folder: the positions
    whose next token's label is not -100."""
    teacher = AutoModelForCausalLM.from_pretrained(source).eval()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        p = F.log_softmax(teacher(**inputs).logits[:, :-1].float(), -1)
    q = F.log_softmax(model(**inputs).logits[:, :-1].detach().float(), -1)  # a DKM training forward: with grad
    per_position = (p.exp() * (p - q)).sum(-1)  # [B, S-1]
    return per_position[batch["labels"][:, 1:] != -100].mean()


def test_the_training_loss_is_the_kl_from_the_source_on_the_same_batch(run_clm, source, tmp_path):
    """The step loss equals an independent KL on the same batch with masked labels left out; split in two
    micro-batches (gradient accumulation) it sums to the same; the source is the folder as loaded, unquantized."""
    args = run_clm.parse_args(["--model_name_or_path", str(source), *DISTIL, *SHORT, "--output_dir", str(tmp_path)])
    built = job.build_model(args, load_tokenizer(args.model))
    train, evaluation = run_clm.prepare_datasets(args, built, run_clm.check_inputs(args))
    trainer = job.build_trainer(args, built, train, evaluation, data_collator=collate)
    batch = next(iter(trainer.get_train_dataloader()))
    batch["labels"][:, :6] = -100  # a prompt, as run_sft.py's labels
    batch["labels"][1, 20:] = -100  # padding
    model = trainer.model.train()
    keep_training_state(model, True)  # as the trainer's callback does when train() begins
    trainer.current_gradient_accumulation_steps = 1  # set by train()
    expected = _independent_kl(source, model, batch)
    assert expected > 0  # the DKM model is not its source

    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(model, batch)
        scored = (batch["labels"][:, 1:] != -100).sum()
        halves = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]
        accumulated = sum(trainer.compute_loss(model, half, num_items_in_batch=scored) for half in halves)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(accumulated, expected, rtol=1e-5, atol=0)
    with torch.no_grad():  # the evaluation keeps the LM loss
        model.eval()
        assert torch.isclose(trainer.compute_loss(model, batch), model(**batch).loss)
    reference = AutoModelForCausalLM.from_pretrained(source).state_dict()
    teacher = trainer._distillation.teacher.state_dict()
    assert teacher.keys() == reference.keys() and all(torch.equal(teacher[k], reference[k]) for k in reference)


def test_a_distilled_run_in_bf16_with_accumulation_and_its_flag_is_part_of_the_run(run_clm, source, tmp_path):
    """A real run: bf16 autocast, 2 micro-batches per step, a logged KL above 0, the results saying which loss it
    is; the flag is in the folder's record and the loss in the checkpoint's: the same folder, or a resume from its
    checkpoint into another, without it is refused."""
    out = tmp_path / "run"
    flags = ["--model_name_or_path", str(source), *DISTIL, *SHORT, "--max_steps", "2", "--bf16", "true",
             "--use_cpu", "true", "--gradient_accumulation_steps", "2", "--save_steps", "2"]  # fmt: skip
    results = run_clm.run([*flags, "--output_dir", str(out)])
    assert results["global_step"] == 2 and results["train_loss_of"].startswith("KL(source || model)")
    logged = [row["loss"] for row in json.loads((out / "trainer_state.json").read_text())["log_history"]
              if "loss" in row]  # fmt: skip
    assert len(logged) == 2 and all(0 < loss < 1 for loss in logged), logged
    assert json.loads((out / "llmkit_flags.json").read_text())["distill_from_source"] is True
    assert json.loads((out / "checkpoint-2" / "llmkit_run.json").read_text())["distillation"] is True
    without = [*flags, "--distill_from_source", "false"]  # the last value of a flag wins
    with pytest.raises(run_clm.UsageError, match=r"--distill_from_source: true -> false"):
        run_clm.run([*without, "--output_dir", str(out)])
    elsewhere = [*without, "--output_dir", str(tmp_path / "b"), "--resume_from_checkpoint", str(out / "checkpoint-2")]
    with pytest.raises(ResumeError, match=r"belongs to a different run \(distillation: true -> false\)"):
        run_clm.run(elsewhere)
    # the compact model it saved, continued by distillation from its source named as the teacher
    again = ["--model_name_or_path", str(out), *DISTIL, TEACHER, str(source), *SHORT, "--max_steps", "1",
             "--do_eval", "false", "--save_strategy", "no", "--output_dir", str(tmp_path / "again")]  # fmt: skip
    results = run_clm.run(again)
    assert results["train_loss"] > 0
    assert results["train_loss_of"] == f"KL(teacher || model), distillation from {source}"


def test_a_lora_adapter_on_the_dkm_model_learns_from_the_source(run_clm, source, tmp_path):
    flags = ["--model_name_or_path", str(source), *DISTIL, *SHORT, "--output_dir", str(tmp_path), "--max_steps", "1",
             "--peft_method", "lora", "--do_eval", "false", "--save_strategy", "no"]  # fmt: skip
    results = run_clm.run(flags)
    assert results["train_loss"] > 0 and results["trainable_parameters"] < results["parameters"]


def test_another_model_of_the_vocabulary_teaches_a_run_without_quantization(run_clm, source, tmp_path):
    teacher = tmp_path / "teacher"
    tiny_llama(hidden_size=32, intermediate_size=64).save_pretrained(teacher)
    flags = ["--model_name_or_path", str(source), "--distill_from_source", "true", "--teacher_model_name_or_path",
             str(teacher), *SHORT, "--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--do_eval", "false",
             "--save_strategy", "no"]  # fmt: skip
    results = run_clm.run(flags)
    assert results["train_loss"] > 0 and results["train_loss_of"].startswith("KL(teacher || model)")


def _config_only(folder, **sizes):
    """A folder with only a config.json (what the checks before any work read), DKM-compact without `sizes`."""
    folder.mkdir()
    config = tiny_llama(**sizes).config.to_dict()
    if not sizes:
        config["quantization_config"] = {"quant_method": "dkm", "bits": 3}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


ON = ["--distill_from_source", "true"]
TEACHER = "--teacher_model_name_or_path"
ZERO3 = '{"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}'


@pytest.mark.parametrize(
    ("model", "flags", "line"),
    [
        ("source", ON, "without --quantization dkm the model is its source (the loss is 0 and nothing trains)"),
        (
            "source",
            [*ON, "--load_in_kbits", "4", "--peft_method", "lora"],
            "a --load_in_kbits 4 base is not supported",
        ),
        (None, DISTIL, "a model built from scratch has no source: pass --model_name_or_path"),
        ("compact", DISTIL, "is a compact DKM checkpoint (3-bit), which holds no uncompressed source: pass that"),
        ("source", [*DISTIL, TEACHER, "compact"], "is a compact DKM checkpoint: pass the uncompressed model"),
        ("source", [*DISTIL, TEACHER, "small"], "has a vocabulary of 256 tokens and the model 512"),
        ("source", [*DISTIL, "--do_train", "false"], "it is a training loss and --do_train false trains nothing"),
        ("source", [*DISTIL, "--tiled_loss", "true"], "--tiled_loss never forms the whole logits"),
        ("source", [*DISTIL, "--label_smoothing_factor", "0.1"], "--label_smoothing_factor smooths the LM loss"),
        ("source", [*DISTIL, "--peft_method", "ptuning"], "--peft_method ptuning adds virtual tokens the source"),
        ("source", [*DISTIL, "--deepspeed", ZERO3], "DeepSpeed ZeRO-3 would partition the source as it loads"),
    ],
    ids=["no-dkm", "kbit", "scratch", "compact", "compact-teacher", "other-vocabulary", "no-train", "tiled-loss",
         "smoothing", "ptuning", "zero3"],
)  # fmt: skip
def test_what_cannot_distil_is_refused_in_one_line(run_clm, source, tmp_path, model, flags, line):
    folders = {"source": str(source), "compact": _config_only(tmp_path / "compact"),
               "small": _config_only(tmp_path / "small", vocab_size=256)}  # fmt: skip
    argv = ["--model_name_or_path", folders[model]] if model else []
    environ = dict(os.environ)
    try:
        with pytest.raises(run_clm.UsageError) as error:
            run_clm.parse_args([*argv, *[folders.get(f, f) for f in flags], "--output_dir", str(tmp_path / "out")])
    finally:
        if "--deepspeed" in flags:  # its arguments set a process-wide ZeRO-3 config that later models would obey
            fresh_trainer_state(environ)
    assert str(error.value).startswith("--distill_from_source true: ") and line in str(error.value)
    assert "\n" not in str(error.value)
    if model == "source" and flags == ON:  # a teacher folder alone needs the flag
        with pytest.raises(run_clm.UsageError, match=f"^{TEACHER} has no effect without --distill_from_source true"):
            run_clm.parse_args([*argv, TEACHER, str(source), "--output_dir", str(tmp_path / "out")])
