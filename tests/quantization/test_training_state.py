"""DKM Trainer checkpoints resume bit for bit: a plain `Trainer` run with `DKMTrainingStateCallback` stopped after a
checkpoint and resumed in a fresh process ends with the same latent weights, tables and saved model as an
uninterrupted run (its final calibration included, `DKMConfig(calibration_samples=4)`); the final model stays
compact."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import DKMLinear, DKMTrainingStateCallback, PalettizedLinear, keep_training_state
from hf_llmkit.testing import tiny_llama
from tests import warm

STEPS, SAVE_EVERY = 6, 3
Q_PROJ = "model.layers.0.self_attn.q_proj"


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def train(base: str, out: str, mode: str, ids: str, block: int = 0) -> None:
    """One Trainer run of a DKM model (block scales per `block` input features, none for 0): "full" (all steps),
    "stop" (SIGKILLed right after checkpoint-3, the checkpoint complete), or "resume" (from checkpoint-3 of `out`).
    Runs in this process or a fresh one."""
    import signal

    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    class KillAfterCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    # calibration_samples: the run ends with GPTQ's rounding onto the tables, which must resume to the same bits too
    config = DKMConfig(bits=3, calibration_samples=4, scale_block_size=block)
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=config)
    args = TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        save_steps=SAVE_EVERY,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    callbacks = [DKMTrainingStateCallback(), *([KillAfterCheckpoint()] if mode == "stop" else [])]
    trainer = Trainer(model=model, args=args, train_dataset=_Rows(torch.load(ids)), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=f"{out}/checkpoint-{SAVE_EVERY}" if mode == "resume" else None)
    trainer.save_model(f"{out}/final")
    torch.save(
        {k: v for k, v in model.state_dict().items() if k.endswith(("weight", "centroids", "scales"))},
        f"{out}/state.pt",
    )


def _fresh_process(base: Path, out: Path, mode: str, ids: Path, block: int) -> int:
    """`train` in a process of its own (this file run as a script, forked from tests/warm.py's interpreter: nothing
    of this process's runs is in it); its exit status."""
    proc = warm.run_script(__file__, [base, out, mode, ids, block], timeout=300)
    if proc.returncode not in (0, -9):
        print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
    return proc.returncode


@pytest.fixture(scope="module", params=[0, 16], ids=["plain", "block_scales"])
def runs(tmp_path_factory, request):
    """An uninterrupted run (here), and one SIGKILLed right after checkpoint-3, then resumed in a fresh process;
    without and with block scales (`scale_block_size=16`)."""
    block = request.param
    tmp = tmp_path_factory.mktemp("dkm_resume_block_scales" if block else "dkm_resume_plain")
    base, ids = tmp / "base", tmp / "ids.pt"
    tiny_llama().save_pretrained(base)
    torch.save(torch.randint(0, 256, (8, 24), generator=torch.Generator().manual_seed(1)), ids)
    train(str(base), str(tmp / "full"), "full", str(ids), block)
    assert _fresh_process(base, tmp / "split", "stop", ids, block) == -9
    assert not (tmp / "split" / "final").exists()
    assert _fresh_process(base, tmp / "split", "resume", ids, block) == 0
    return tmp


def test_resumed_run_ends_bitwise_equal(runs):
    full, resumed = torch.load(runs / "full" / "state.pt"), torch.load(runs / "split" / "state.pt")
    assert full.keys() == resumed.keys() and f"{Q_PROJ}.centroids" in full
    assert (f"{Q_PROJ}.scales" in full) == ("block_scales" in runs.name)
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
    final_full = load_file(runs / "full" / "final" / "model.safetensors")
    final_resumed = load_file(runs / "split" / "final" / "model.safetensors")
    assert final_full.keys() == final_resumed.keys()
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)
    base = load_file(runs / "base" / "model.safetensors")
    assert not torch.equal(full[f"{Q_PROJ}.weight"], base[f"{Q_PROJ}.weight"])  # it trained


def test_checkpoints_hold_training_state_final_model_is_compact(runs):
    with safe_open(runs / "full" / f"checkpoint-{SAVE_EVERY}" / "model.safetensors", framework="pt") as f:
        ckpt = set(f.keys())
    assert {f"{Q_PROJ}.{n}" for n in ("weight", "centroids", "weight_packed", "weight_lut")} <= ckpt
    with safe_open(runs / "full" / "final" / "model.safetensors", framework="pt") as f:
        final = set(f.keys())
        stand_in = f.get_slice(f"{Q_PROJ}.weight").get_shape()  # one byte in place of the latent weight
    assert {f"{Q_PROJ}.weight_packed", f"{Q_PROJ}.weight_lut"} <= final
    assert not any(k.endswith(".centroids") for k in final) and stand_in == [1]


def test_from_pretrained_of_a_checkpoint_restores_the_training_state(runs, caplog):
    from transformers import AutoModelForCausalLM

    ckpt = runs / "full" / f"checkpoint-{SAVE_EVERY}"
    with caplog.at_level(logging.WARNING):
        model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert "unexpected" not in caplog.text.lower() and "newly initialized" not in caplog.text.lower()
    q = model.get_submodule(Q_PROJ)
    assert isinstance(q, DKMLinear)
    saved = load_file(ckpt / "model.safetensors")
    assert torch.equal(q.weight.detach(), saved[f"{Q_PROJ}.weight"])
    assert torch.equal(q.centroids, saved[f"{Q_PROJ}.centroids"])
    assert q.scales is None or torch.equal(q.scales, saved[f"{Q_PROJ}.scales"])
    final = AutoModelForCausalLM.from_pretrained(runs / "full" / "final")
    assert isinstance(final.get_submodule(Q_PROJ), PalettizedLinear)


def test_compact_checkpoint_resume_warns_that_it_is_not_bitwise(tmp_path, caplog):
    from hf_llmkit.quantization import quantize_model

    model = quantize_model(tiny_llama(), DKMConfig(bits=3))
    model.save_pretrained(tmp_path)  # compact
    fresh = quantize_model(tiny_llama(), DKMConfig(bits=3))
    with caplog.at_level(logging.WARNING):
        fresh.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert "will not match an uninterrupted one bit for bit" in caplog.text
    q = fresh.get_submodule(Q_PROJ)
    model.eval()
    assert torch.equal(q.weight.detach(), model.get_submodule(Q_PROJ).hard_weight(torch.float32))


def test_no_process_wide_callback_llmkit_trainer_adds_one(tmp_path, caplog):
    """Quantizing changes no transformers global: a plain Trainer (DKM model or not) starts without the callback;
    `LLMKitTrainer` adds exactly one to a DKM model's run (also when one was passed, with no duplicate warning) and
    none to any other model's."""
    import transformers
    from transformers import Trainer, TrainingArguments

    from hf_llmkit.quantization import quantize_model
    from hf_llmkit.trainers import LLMKitTrainer

    defaults = list(transformers.trainer.DEFAULT_CALLBACKS)
    model = quantize_model(tiny_llama(), DKMConfig(bits=2))
    assert defaults == transformers.trainer.DEFAULT_CALLBACKS and DKMTrainingStateCallback not in defaults
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])

    def count(trainer) -> int:
        return sum(isinstance(cb, DKMTrainingStateCallback) for cb in trainer.callback_handler.callbacks)

    with caplog.at_level(logging.WARNING):
        assert count(Trainer(model=model, args=args)) == 0
        assert count(Trainer(model=tiny_llama(), args=args)) == 0
        assert count(LLMKitTrainer(model=model, args=args)) == 1
        assert count(LLMKitTrainer(model=model, args=args, callbacks=[DKMTrainingStateCallback()])) == 1
        assert count(LLMKitTrainer(model=tiny_llama(), args=args)) == 0
    assert "already" not in caplog.text


def _train_without_callback(tmp_path, config: DKMConfig) -> None:
    from transformers import Trainer, TrainingArguments

    from hf_llmkit.quantization import quantize_model

    torch.manual_seed(0)
    model = quantize_model(tiny_llama(), config)
    args = TrainingArguments(str(tmp_path), max_steps=1, use_cpu=True, report_to=[], save_strategy="no")
    Trainer(model=model, args=args, train_dataset=_Rows(torch.randint(0, 256, (4, 16)))).train()


def test_forgetting_the_callback_is_loud(tmp_path):
    """A plain Trainer without `DKMTrainingStateCallback`: asked-for calibration fails before the first step, and
    otherwise a warning says the checkpoints would not resume bit for bit."""
    with pytest.raises(ValueError, match="calibration_samples=...\\) would never run.*DKMTrainingStateCallback"):
        _train_without_callback(tmp_path, DKMConfig(bits=2, calibration_samples=2))
    with pytest.warns(UserWarning, match="would not resume bit for bit.*DKMTrainingStateCallback"):
        _train_without_callback(tmp_path, DKMConfig(bits=2))


def test_trl_sft_trainer_with_the_callback_calibrates_once(tmp_path, monkeypatch):
    """TRL's SFTTrainer (its defaults: bf16 autocast) with `DKMTrainingStateCallback` in `callbacks` ends with exactly
    one `calibrate`."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_llmkit.data.corpus import corpus_tokenizer
    from hf_llmkit.quantization import quantize_model, training_state

    calls = []
    real = training_state.calibrate
    monkeypatch.setattr(training_state, "calibrate", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = quantize_model(tiny_llama(), DKMConfig(bits=3, calibration_samples=4))
    rows = torch.randint(0, 256, (8, 24), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": rows.tolist()})
    args = SFTConfig(str(tmp_path), max_steps=1, per_device_train_batch_size=2, use_cpu=True, report_to=[],
                     save_strategy="no")  # fmt: skip
    tokenizer = corpus_tokenizer(vocab_size=512)
    callbacks = [DKMTrainingStateCallback()]
    SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=callbacks).train()
    assert calls == [1]


def test_keep_training_state_switch(tmp_path):
    from hf_llmkit.quantization import quantize_model

    model = quantize_model(tiny_llama(), DKMConfig(bits=2))
    assert keep_training_state(model) == 14  # 7 projections x 2 layers
    model.save_pretrained(tmp_path / "on")
    keep_training_state(model, False)
    model.save_pretrained(tmp_path / "off")
    on, off = (load_file(tmp_path / d / "model.safetensors") for d in ("on", "off"))
    assert on[f"{Q_PROJ}.weight"].shape == (64, 64) and off[f"{Q_PROJ}.weight"].shape == (1,)  # a one-byte stand-in
    assert f"{Q_PROJ}.weight_packed" in off
    assert keep_training_state(tiny_llama()) == 0
    callback = DKMTrainingStateCallback()
    callback.on_train_begin(None, None, None, model=model)
    assert model.get_submodule(Q_PROJ).keep_training_state
    callback.on_train_end(None, None, None, model=model)
    assert not model.get_submodule(Q_PROJ).keep_training_state


if __name__ == "__main__":  # `python test_training_state.py BASE OUT MODE IDS BLOCK`: one `train` run (_fresh_process)
    train(*sys.argv[1:5], int(sys.argv[5]))
