"""P-tuning v1 (`PTuningConfig`): templates, the embedding wrapper, saving/resuming, peft behaviours, 4-bit, ZeRO-3."""

from __future__ import annotations

import os

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from torch import nn

from hf_llmkit import PTuningConfig, PTuningTemplate, build_ptuning_template
from hf_llmkit.testing import corpus_tokenizer, tiny_llama
from tests.tuners.support import VOCAB, examples, fresh_logits, quantized_tiny_llama, snapshot, trainer


def _virtual_batch() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[VOCAB, VOCAB + 1, 7, 8, 9, VOCAB + 2, 10], [11, VOCAB, VOCAB + 1, 12, 13, 14, VOCAB + 2]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_virtual_tokens": 0}, "num_virtual_tokens must be an int >= 1"),
        ({"num_virtual_tokens": 4, "template": "[P0][P1] {text} [P2]"}, r"does not place the virtual tokens \[P3\]"),
        ({"num_virtual_tokens": 2, "template": "[P0][P1] {text} [P2]"}, r"raise num_virtual_tokens"),
        ({"num_virtual_tokens": 2, "template": "[P0][P1] no field"}, "needs named placeholders"),
        ({"num_virtual_tokens": 2, "template": "[P0][P1] {}"}, "needs named placeholders"),
        ({"num_virtual_tokens": 2, "template": "[P0][P0][P1] {text}"}, "repeats a virtual token"),
        ({"encoder_reparameterization_type": "GRU"}, "'MLP' or 'LSTM'"),
        ({"encoder_dropout": 1.0}, r"encoder_dropout must be in \[0, 1\)"),
        ({"virtual_token_start_id": -1}, "virtual_token_start_id must be >= 0"),
    ],
)
def test_bad_config_names_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PTuningConfig(**kwargs)


def test_build_template_and_tokenizer_helper():
    assert build_ptuning_template(3, " {text} ", 1) == "[P0][P1][P2] {text} [P3]"
    with pytest.raises(ValueError, match="needs named placeholders"):
        build_ptuning_template(2, " plain text")
    tokenizer = corpus_tokenizer(vocab_size=400)
    size = len(tokenizer)
    config = PTuningConfig(num_virtual_tokens=4, template=build_ptuning_template(2, " {question} ", 2))
    template = PTuningTemplate(tokenizer, config)
    assert template.virtual_token_ids == list(range(size, size + 4)) and config.virtual_token_start_id == size
    encoded = template(question="what is a tuple?", return_tensors="pt")
    ids, labels = encoded["input_ids"][0], encoded["labels"][0]
    assert ids[:2].tolist() == [size, size + 1] and ids[-2:].tolist() == [size + 2, size + 3]
    assert (labels == -100).sum() == 4 and torch.equal(labels[2:-2], ids[2:-2])
    # Re-binding the same tokenizer is idempotent; a tokenizer that puts [P0] elsewhere is refused.
    assert PTuningTemplate(tokenizer, config).virtual_token_ids == template.virtual_token_ids
    other = PTuningConfig(num_virtual_tokens=4, virtual_token_start_id=7)
    with pytest.raises(ValueError, match="expects \\[P0\\] at id 7"):
        PTuningTemplate(tokenizer, other)
    second = PTuningTemplate(tokenizer, PTuningConfig(num_virtual_tokens=2), namespace="task2")
    assert second.virtual_token_ids == [size + 4, size + 5] and "[task2:P0]" in second.format(text="x")
    with pytest.raises(ValueError, match="needs the fields"):
        template.format(text="wrong field")
    two_fields = PTuningConfig(num_virtual_tokens=2, template="[P0] {premise} [P1] {hypothesis}")
    with pytest.raises(ValueError, match="one field"):
        PTuningTemplate(tokenizer, two_fields, namespace="nli").wrap_ids([1, 2, 3])
    block = PTuningTemplate(tokenizer, PTuningConfig(num_virtual_tokens=2), namespace="lm")
    wrapped = block.wrap_ids(list(range(10, 30)), max_length=16)
    assert len(wrapped["input_ids"]) == 16 and wrapped["input_ids"][2:] == list(range(10, 24))
    assert wrapped["labels"][:2] == [-100, -100] and wrapped["labels"][2:] == list(range(10, 24))
    with pytest.raises(ValueError, match="raise max_length"):
        block.wrap_ids([1, 2], max_length=16)


def test_target_that_matches_nothing_lists_close_candidates():
    with pytest.raises(ValueError, match=r"'embed_tokns' -> did you mean \['embed_tokens'"):
        get_peft_model(tiny_llama(), PTuningConfig(target_modules=["embed_tokns"]))
    with pytest.raises(TypeError, match="wraps the input embedding"):
        get_peft_model(tiny_llama(), PTuningConfig(target_modules=["q_proj"]))


def test_targeting_embed_tokens_by_name_saves_only_the_encoder(tmp_path):
    peft_model = get_peft_model(tiny_llama(), PTuningConfig(num_virtual_tokens=2, target_modules=["embed_tokens"]))
    assert peft_model.peft_config["default"].target_modules == {"model.embed_tokens"}
    peft_model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert saved and all(".ptuning_encoder." in k for k in saved)


def test_tied_embeddings_stay_tied_without_warnings(tmp_path, recwarn):
    model = tiny_llama(tie_word_embeddings=True)
    peft_model = get_peft_model(model, PTuningConfig(num_virtual_tokens=2))
    assert not [w for w in recwarn if "tie_word_embeddings" in str(w.message)]
    assert model.lm_head.weight is peft_model.get_input_embeddings().base_layer.weight
    peft_model.save_pretrained(tmp_path)
    ids = torch.tensor([[VOCAB, VOCAB + 1, 5, 6]])
    with torch.no_grad():
        reloaded = PeftModel.from_pretrained(tiny_llama(tie_word_embeddings=True), tmp_path)
        torch.testing.assert_close(reloaded(input_ids=ids).logits, peft_model.eval()(input_ids=ids).logits)


def test_ensure_weight_tying_with_a_tied_lm_head_to_save_is_refused_in_one_line():
    """Tying lm_head's trained copy to the input embedding would train the embedding P-tuning wraps."""
    config = PTuningConfig(num_virtual_tokens=2, modules_to_save=["lm_head"], ensure_weight_tying=True)
    with pytest.raises(ValueError, match=r"cannot tie \['lm_head'\].*set ensure_weight_tying=False") as err:
        get_peft_model(tiny_llama(tie_word_embeddings=True), config)
    assert "\n" not in str(err.value)
    config = PTuningConfig(num_virtual_tokens=2, modules_to_save=["lm_head"])
    with pytest.warns(UserWarning, match="ensure_weight_tying"):  # peft's: lm_head trains as its own copy
        peft_model = get_peft_model(tiny_llama(tie_word_embeddings=True), config)
    assert peft_model.base_model.model.lm_head.modules_to_save["default"].weight is not (
        peft_model.get_input_embeddings().base_layer.weight
    )


def test_virtual_ids_use_the_encoder_and_other_ids_the_frozen_base():
    model = tiny_llama()
    base_rows = model.get_input_embeddings().weight.detach().clone()
    peft_model = get_peft_model(model, PTuningConfig(num_virtual_tokens=3))
    wrapper = peft_model.get_input_embeddings()
    ids = _virtual_batch()["input_ids"]
    out = wrapper(ids)
    prompts = wrapper.ptuning_encoder["default"]()
    virtual = ids >= VOCAB
    assert torch.equal(out[~virtual], base_rows[ids[~virtual]])
    assert torch.equal(out[virtual], prompts[ids[virtual] - VOCAB])
    assert peft_model.peft_config["default"].virtual_token_start_id == VOCAB
    assert not wrapper.base_layer.weight.requires_grad
    assert all(p.requires_grad for p in wrapper.ptuning_encoder.parameters())


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_match_unpadded_sequences(side):
    peft_model = get_peft_model(tiny_llama(), PTuningConfig(num_virtual_tokens=3)).eval()
    short = torch.tensor([VOCAB, VOCAB + 1, 7, 8, VOCAB + 2])
    long = torch.tensor([VOCAB, VOCAB + 1, 9, 10, 11, 12, VOCAB + 2])
    pad = torch.zeros(2, dtype=torch.long)
    padded = torch.cat([pad, short]) if side == "left" else torch.cat([short, pad])
    ids = torch.stack([padded, long])
    mask = (torch.arange(7) >= 2).long() if side == "left" else (torch.arange(7) < 5).long()
    mask = torch.stack([mask, torch.ones(7, dtype=torch.long)])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batch = peft_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        alone = peft_model(input_ids=short[None]).logits[0]
        alone_long = peft_model(input_ids=long[None]).logits[0]
    real = mask[0].bool()
    torch.testing.assert_close(batch[0][real], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch[1], alone_long, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per encoder: a Trainer run, its saved adapter, the in-process logits, and the logits reloaded elsewhere."""
    runs, batch = {}, _virtual_batch()
    for encoder in ("MLP", "LSTM"):
        tmp = tmp_path_factory.mktemp(f"ptuning_{encoder}")
        config = PTuningConfig(num_virtual_tokens=3, encoder_reparameterization_type=encoder, encoder_hidden_size=32)
        peft_model = get_peft_model(tiny_llama(), config)
        before = snapshot(peft_model, "ptuning_encoder")
        trainer(peft_model, examples(8, virtual=3), tmp / "run").train()
        peft_model.save_pretrained(tmp / "adapter")
        with torch.no_grad():
            expected = peft_model.eval()(**batch).logits
        runs[encoder] = dict(
            dir=tmp / "adapter", before=before, after=snapshot(peft_model, "ptuning_encoder"), expected=expected
        )
    reloaded = fresh_logits([(run["dir"], batch["input_ids"], batch["attention_mask"]) for run in runs.values()])
    for run, logits in zip(runs.values(), reloaded):
        run["reloaded"] = logits
    return runs


@pytest.mark.parametrize("encoder", ["MLP", "LSTM"])
def test_trainer_save_and_fresh_process_reload_give_identical_logits(trained, encoder):
    run = trained[encoder]
    before, after = run["before"], run["after"]
    assert any(not torch.equal(before[k], after[k]) for k in before), "training did not move the prompt encoder"
    files = set(os.listdir(run["dir"]))
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "model.safetensors" not in files
    saved = load_file(run["dir"] / "adapter_model.safetensors")
    assert saved and all(".ptuning_encoder." in k for k in saved)  # the encoder, nothing of the base model
    assert len(saved) == len(after) and all(v.numel() > 0 for v in saved.values())
    torch.testing.assert_close(run["reloaded"], run["expected"], rtol=0, atol=0)
    lazy = PeftModel.from_pretrained(tiny_llama(), run["dir"], low_cpu_mem_usage=True, is_trainable=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(lazy(**_virtual_batch()).logits, run["expected"], rtol=0, atol=0)


def test_resume_from_checkpoint_continues_exactly(tmp_path):
    """peft issue #1247: its P-tuning saves only the encoder's output, so training cannot resume; ours does."""
    data = examples(8, virtual=3)
    uninterrupted = get_peft_model(tiny_llama(), PTuningConfig(num_virtual_tokens=3))
    run = trainer(uninterrupted, data, tmp_path / "a", save_strategy="steps", save_steps=2)
    run.train()
    final = snapshot(uninterrupted, "ptuning_encoder")
    checkpoint = tmp_path / "a" / "checkpoint-2"

    reloaded = PeftModel.from_pretrained(tiny_llama(), checkpoint, is_trainable=True)
    params = snapshot(reloaded, "ptuning_encoder")
    assert params and all(p.requires_grad for k, p in reloaded.named_parameters() if "ptuning_encoder" in k)
    saved = load_file(checkpoint / "adapter_model.safetensors")
    assert {k.replace(".default.", "."): v for k, v in params.items()}.keys() == saved.keys()
    assert all(torch.equal(params[k], saved[k.replace(".default.", ".")]) for k in params)

    base = tiny_llama()
    torch.manual_seed(123)  # a different fresh encoder: the checkpoint must overwrite it
    resumed = get_peft_model(base, PTuningConfig(num_virtual_tokens=3))
    assert not torch.equal(next(iter(snapshot(resumed, "ptuning_encoder").values())), next(iter(params.values())))
    resumed_run = trainer(resumed, data, tmp_path / "b", save_strategy="steps", save_steps=2)
    resumed_run.train(resume_from_checkpoint=str(checkpoint))
    assert resumed_run.state.global_step == 4
    for key, value in snapshot(resumed, "ptuning_encoder").items():
        torch.testing.assert_close(value, final[key], rtol=0, atol=1e-6)
    # The model reloaded with is_trainable=True continues the same way (optimizer state from the checkpoint).
    trainer(reloaded, data, tmp_path / "c").train(resume_from_checkpoint=str(checkpoint))
    for key, value in snapshot(reloaded, "ptuning_encoder").items():
        torch.testing.assert_close(value, final[key], rtol=0, atol=1e-6)


def test_generate_with_and_without_cache_agree():
    peft_model = get_peft_model(tiny_llama(), PTuningConfig(num_virtual_tokens=3)).eval()
    batch = _virtual_batch()
    cached = peft_model.generate(**batch, max_new_tokens=6, do_sample=False)
    uncached = peft_model.generate(**batch, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    assert (cached[:, 7:] < VOCAB).all()  # a virtual token is never generated
    with peft_model.disable_adapter():
        different = peft_model.generate(input_ids=batch["input_ids"].clamp(max=VOCAB - 1), max_new_tokens=6)
    assert different.shape == cached.shape


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    model.train()
    batch = _virtual_batch()
    model(**batch, labels=batch["input_ids"].masked_fill(batch["input_ids"] >= VOCAB, -100)).loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("when", ["before", "after"])
def test_gradient_checkpointing_gives_the_same_gradients(when):
    reference = _grads(get_peft_model(tiny_llama(), PTuningConfig(num_virtual_tokens=3)))
    model = tiny_llama()
    if when == "before":
        model.activation_checkpointing_enable()
    peft_model = get_peft_model(model, PTuningConfig(num_virtual_tokens=3))
    if when == "after":
        peft_model.gradient_checkpointing_enable()
    assert peft_model.base_model.model.is_activation_checkpointing
    grads = _grads(peft_model)
    assert set(grads) == set(reference) and grads
    for key in grads:
        torch.testing.assert_close(grads[key], reference[key], rtol=1e-5, atol=1e-6)


def test_multiple_adapters_disable_unload_and_merge_refusal(capsys):
    model = tiny_llama()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        base = model(input_ids=ids).logits
    peft_model = get_peft_model(model, PTuningConfig(num_virtual_tokens=3))
    peft_model.add_adapter("other", PTuningConfig(num_virtual_tokens=2, virtual_token_start_id=VOCAB + 3))
    with pytest.raises(ValueError, match="overlap those of adapter 'default'"):
        peft_model.add_adapter("clash", PTuningConfig(num_virtual_tokens=2, virtual_token_start_id=VOCAB + 1))
    peft_model.print_trainable_parameters()
    assert "trainable params" in capsys.readouterr().out
    peft_model.eval()
    with torch.no_grad():
        first = peft_model(input_ids=torch.tensor([[VOCAB, VOCAB + 1, 5, 6]])).logits
        with pytest.raises(ValueError, match="not a virtual token of the active adapter"):
            peft_model(input_ids=torch.tensor([[VOCAB + 3, 5]]))  # "other"'s token while "default" is active
        peft_model.set_adapter("other")
        second = peft_model(input_ids=torch.tensor([[VOCAB + 3, VOCAB + 4, 5, 6]])).logits
        assert not torch.allclose(first, second)
        peft_model.base_model.set_adapter(["default", "other"])  # both active: each embeds its own ids
        both = peft_model(input_ids=torch.tensor([[VOCAB, VOCAB + 1, VOCAB + 3, VOCAB + 4, 5, 6]])).logits
        assert both.shape[1] == 6
        peft_model.set_adapter("other")
        assert all(p.requires_grad == ("other" in k) for k, p in peft_model.named_parameters() if "ptuning" in k)
        with peft_model.disable_adapter():
            torch.testing.assert_close(peft_model(input_ids=ids).logits, base, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot merge.*unload"):
        peft_model.merge_and_unload()
    unloaded = peft_model.unload()
    assert type(unloaded.get_input_embeddings()) is nn.Embedding
    with torch.no_grad():
        torch.testing.assert_close(unloaded(input_ids=ids).logits, base, rtol=0, atol=0)


def test_on_a_bitsandbytes_4bit_base(tmp_path):
    pytest.importorskip("bitsandbytes")
    peft_model = get_peft_model(quantized_tiny_llama(tmp_path / "base"), PTuningConfig(num_virtual_tokens=3))
    before = snapshot(peft_model, "ptuning_encoder")
    trainer(peft_model, examples(4, virtual=3), tmp_path / "run", max_steps=2).train()
    assert any(not torch.equal(before[k], v) for k, v in snapshot(peft_model, "ptuning_encoder").items())
    peft_model.save_pretrained(tmp_path / "adapter")
    batch = _virtual_batch()
    with torch.no_grad():
        expected = peft_model.eval()(**batch).logits
        reloaded = PeftModel.from_pretrained(quantized_tiny_llama(tmp_path / "base2"), tmp_path / "adapter").eval()
        torch.testing.assert_close(reloaded(**batch).logits, expected, rtol=0, atol=0)


class _TextClassifier(nn.Module):
    """A small custom (non-transformers) module: embedding -> mean -> linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(input_ids).mean(1))


def test_custom_module_round_trip_disable_and_unload(tmp_path):
    torch.manual_seed(0)
    model = _TextClassifier().eval()
    ids = torch.tensor([[20, 21, 3, 4], [5, 20, 21, 6]])
    with torch.no_grad():
        base = model(ids.clamp(max=19))
    with pytest.raises(ValueError, match="set target_modules"):
        get_peft_model(_TextClassifier(), PTuningConfig(num_virtual_tokens=2))
    peft_model = get_peft_model(model, PTuningConfig(num_virtual_tokens=2, target_modules=["emb"]))
    assert peft_model.peft_config["default"].virtual_token_start_id == 20
    with torch.no_grad():
        adapted = peft_model(ids)
        peft_model.save_pretrained(tmp_path)
        torch.manual_seed(0)
        reloaded = PeftModel.from_pretrained(_TextClassifier().eval(), tmp_path)
        torch.testing.assert_close(reloaded(ids), adapted, rtol=0, atol=0)
        with peft_model.disable_adapter():
            torch.testing.assert_close(peft_model(ids.clamp(max=19)), base, rtol=0, atol=0)
        torch.testing.assert_close(peft_model.unload()(ids.clamp(max=19)), base, rtol=0, atol=0)
