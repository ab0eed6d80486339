"""SavePeftModelCallback: adapters (peft LoRA, hf_llmkit bottleneck/BitFit) + tokenizer + merged model, verified."""

from __future__ import annotations

import logging

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import hf_llmkit
from hf_llmkit.callbacks import AdapterSaveError, SavePeftModelCallback
from hf_llmkit.callbacks.save_peft import verify_adapter_folder
from hf_llmkit.testing import tiny_llama
from tests import warm
from tests.callbacks.peft_support import reload_logits, zero3_lora_run
from tests.callbacks.support import make_trainer, small_model

IDS = torch.tensor([[5, 17, 33, 64, 90, 101, 7, 12]])


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(20)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]")


def _train(tmp_path, config, **callback_kwargs):
    model = get_peft_model(small_model(), config)
    trainer = make_trainer(
        tmp_path,
        model=model,
        plain=True,
        max_steps=4,
        save_steps=2,
        learning_rate=5e-2,
        callbacks=[SavePeftModelCallback(**callback_kwargs)],
    )
    trainer.processing_class = _tokenizer()
    trainer.callback_handler.processing_class = trainer.processing_class
    trainer.train()
    return model.eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_lora_adapter_tokenizer_and_merged_model_round_trip(tmp_path):
    model = _train(
        tmp_path, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False), save_merged=True
    )
    for root in (tmp_path / "checkpoint-2", tmp_path / "checkpoint-4", tmp_path):
        assert (root / "adapter" / "adapter_model.safetensors").is_file()
        assert (root / "adapter" / "tokenizer.json").is_file()
        assert (root / "merged" / "model.safetensors").is_file()
    assert not list(tmp_path.rglob("*.llmkit-tmp*"))
    expected = _logits(model)
    # The final adapter reloads in a fresh process (a child of the warm interpreter, tests/warm.py, which never saw
    # the training run) onto the untouched base model: identical outputs.
    fresh = warm.call(reload_logits, 0, str(tmp_path / "adapter"), IDS, timeout=180)
    torch.testing.assert_close(fresh, expected, rtol=0, atol=0)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(_logits(merged), expected, rtol=1e-5, atol=1e-5)
    assert AutoTokenizer.from_pretrained(tmp_path / "adapter").get_vocab() == _tokenizer().get_vocab()
    # The checkpoint copy is the adapter as it was at step 2, not the final one.
    at_2 = PeftModel.from_pretrained(small_model().eval(), tmp_path / "checkpoint-2" / "adapter")
    assert not torch.equal(_logits(at_2), expected)


@pytest.mark.parametrize(
    "config, mergeable",
    [
        (lambda: hf_llmkit.BottleneckConfig(target_modules=["mlp"], init_weights=False), False),
        (lambda: hf_llmkit.BitFitConfig(target_modules=["q_proj", "v_proj"], add_missing_biases=True), True),
    ],
    ids=["bottleneck", "bitfit"],
)
def test_hf_llmkit_methods(tmp_path, caplog, config, mergeable):
    with caplog.at_level(logging.WARNING, logger="hf_llmkit.callbacks.save_peft"):
        model = _train(tmp_path, config(), save_merged=True)
    reloaded = PeftModel.from_pretrained(small_model().eval(), tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(reloaded), _logits(model), rtol=0, atol=0)
    assert (tmp_path / "merged").is_dir() == mergeable
    if not mergeable:
        assert any("cannot be merged" in r.getMessage() for r in caplog.records)


def test_merged_models_reload_as_the_adapter_model_or_are_skipped(tmp_path, caplog):
    """A LoRA on an embedding tied to the LM head: the merged model unties them (the head kept the base weight) and
    reloads to the adapter model's logits; BitFit biases Mistral's config cannot declare: skipped, one warning."""
    from hf_llmkit.testing import tiny_model

    config = LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False)
    model = get_peft_model(tiny_llama(tie_word_embeddings=True), config).eval()
    SavePeftModelCallback(save_merged=True).save(tmp_path / "lora", model=model)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "merged").eval()
    assert not merged.config.tie_word_embeddings
    torch.testing.assert_close(_logits(merged), _logits(model), rtol=1e-5, atol=1e-5)
    assert model.get_base_model().lm_head.weight is model.get_base_model().model.embed_tokens.base_layer.weight
    bitfit = hf_llmkit.BitFitConfig(target_modules=["q_proj"], add_missing_biases=True)
    model = get_peft_model(tiny_model("mistral", num_hidden_layers=1), bitfit)
    with caplog.at_level(logging.WARNING, logger="hf_llmkit.callbacks.save_peft"):
        SavePeftModelCallback(save_merged=True).save(tmp_path / "bitfit", model=model)
    assert (tmp_path / "bitfit" / "adapter").is_dir() and not (tmp_path / "bitfit" / "merged").exists()
    assert any("would reload without them; skipped" in r.getMessage() for r in caplog.records)


def test_empty_or_misshaped_tensors_fail_loudly(tmp_path):
    expected = {"a.lora_A.weight": (4, 32), "a.lora_B.weight": (32, 4)}
    save_file(
        {"a.lora_A.weight": torch.zeros(0), "a.lora_B.weight": torch.zeros(32, 4)},
        tmp_path / "adapter_model.safetensors",
    )
    with pytest.raises(AdapterSaveError, match=r"lora_A.*expected \(4, 32\)"):
        verify_adapter_folder(tmp_path, expected)
    save_file({"a.lora_B.weight": torch.zeros(32, 4)}, tmp_path / "adapter_model.safetensors")
    with pytest.raises(AdapterSaveError, match="lora_A.weight: missing"):
        verify_adapter_folder(tmp_path, expected)


def test_non_peft_model_is_left_alone(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_llmkit.callbacks.save_peft"):
        make_trainer(tmp_path, plain=True, max_steps=2, callbacks=[SavePeftModelCallback()]).train()
    assert not (tmp_path / "checkpoint-2" / "adapter").exists()
    assert any("not a PeftModel" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kwargs", [dict(subfolder=""), dict(subfolder="a/b"), dict(merged_subfolder="adapter")])
def test_bad_folder_names_name_the_fix(kwargs):
    with pytest.raises(ValueError, match="subfolder"):
        SavePeftModelCallback(**kwargs)


def test_zero3_saves_a_complete_adapter(tmp_path):
    result = warm.launch(zero3_lora_run, str(tmp_path), nprocs=1, timeout=300)[0]  # a rank of its own (tests/warm.py)
    assert result["partitioned"]  # ZeRO-3 really partitioned the parameters
    strip = {k.replace(".default", ""): v for k, v in result["expected"].items()}
    assert result["ours"] == strip and result["final"] == strip
    assert all(0 not in shape for shape in result["ours"].values())


@pytest.mark.parametrize("plain", [True, False], ids=["plain-trainer", "llmkit-trainer"])
def test_resumed_training_saves_the_final_adapter_not_a_checkpoint_copy(tmp_path, plain):
    """Resuming loads checkpoint-N/adapter/ as an extra adapter in a plain Trainer; it must never be trained,
    saved, nested (adapter/adapter) or written over the final adapter."""
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)

    def trainer(max_steps):
        model = get_peft_model(small_model(), config)
        return model, make_trainer(
            tmp_path, model=model, plain=plain, max_steps=max_steps, learning_rate=5e-2,
            callbacks=[SavePeftModelCallback()],
        )  # fmt: skip

    trainer(2)[1].train()
    model, resumed = trainer(4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    resumed.save_model()
    assert list(model.peft_config) == ["default"]
    assert not list(tmp_path.rglob("adapter/adapter"))
    final = PeftModel.from_pretrained(small_model().eval(), tmp_path / "adapter")
    torch.testing.assert_close(_logits(final), _logits(model.eval()), rtol=0, atol=0)
