"""An embedding clustered with the LM head tied to it (`DKMConfig(quantize_embeddings=True)` on a model with
`tie_word_embeddings`) stays one weight: the head multiplies by the embedding's own clustered weight when training,
evaluating, saved (once, under the embedding's name) and reloaded packed; untied or unclustered
embeddings keep transformers' own tie."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import DKMEmbedding, PalettizedEmbedding, lut_gemv, trainable_from_packed
from hf_llmkit.quantization.tied import TiedDKMHead
from hf_llmkit.testing import tiny_llama

CONFIG = dict(bits=3, quantize_embeddings=True, embedding_bits=8, lut_dtype="bfloat16")


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tied")
    tiny_llama(tie_word_embeddings=True).save_pretrained(folder)
    return folder


def test_the_head_is_the_clustered_embedding_and_trains_it(tied_dir):
    model = AutoModelForCausalLM.from_pretrained(tied_dir, quantization_config=DKMConfig(**CONFIG)).eval()
    embedding = model.model.embed_tokens
    assert isinstance(embedding, DKMEmbedding) and embedding.settings.bits == 8
    assert isinstance(model.lm_head, TiedDKMHead) and model.lm_head.embedding is embedding
    assert not list(model.lm_head.parameters()) and "lm_head.weight" not in model.state_dict()
    ids = torch.tensor([[1, 5, 9, 22, 7, 3]])
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        assert torch.equal(model(ids).logits, F.linear(hidden, embedding.hard_weight(torch.float32)))
    model.train()
    head_only = torch.zeros_like(embedding.weight)
    model.lm_head(torch.randn(1, 2, embedding.embedding_dim)).sum().backward()
    head_only += embedding.weight.grad  # the head alone reaches the latent embedding: every row of the table
    assert bool((head_only.abs().sum(1) > 0).all())


def test_saved_once_and_reloaded_packed(tied_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tied_dir, quantization_config=DKMConfig(**CONFIG)).eval()
    model.save_pretrained(tmp_path / "q")
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any(k.startswith("lm_head") for k in names) and "model.embed_tokens.weight_packed" in names
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    assert isinstance(reloaded.lm_head, TiedDKMHead) and isinstance(reloaded.model.embed_tokens, PalettizedEmbedding)
    assert reloaded.lm_head.embedding is reloaded.model.embed_tokens
    ids = torch.tensor([[1, 5, 9, 22, 7, 3, 4, 8, 2, 6, 11] * 2])  # above MAX_FUSED_TOKENS: decoded, bit for bit
    assert lut_gemv.decodes(ids.shape[1], 512 * 64)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
        short = ids[:, :4]  # up to MAX_FUSED_TOKENS: the kernel, within float32 rounding of the reduction
        torch.testing.assert_close(reloaded(short).logits, model(short).logits, rtol=1e-5, atol=1e-5)
        want = model.generate(short, max_new_tokens=4, do_sample=False)
        assert torch.equal(reloaded.generate(short, max_new_tokens=4, do_sample=False), want)
    reloaded.save_pretrained(tmp_path / "again")
    with safe_open(str(tmp_path / "again" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == names  # saved again, the same tensors


def test_made_trainable_again_the_head_follows_the_trainable_embedding(tied_dir, tmp_path):
    """`trainable_from_packed` (a compact checkpoint's DKM training continued, e.g. by the main jobs) replaces the
    packed embedding: the head multiplies by the new one (it trains through the head, and the save is the model)."""
    AutoModelForCausalLM.from_pretrained(tied_dir, quantization_config=DKMConfig(**CONFIG)).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[1, 5, 9, 22, 7, 3, 4, 8, 2, 6, 11]])
    with torch.no_grad():
        packed = model(ids).logits
    trainable_from_packed(model)
    embedding = model.model.embed_tokens
    assert isinstance(embedding, DKMEmbedding) and model.lm_head.embedding is embedding
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, packed, rtol=1e-5, atol=1e-5)
    model.train()
    model.lm_head(torch.randn(1, 2, embedding.embedding_dim)).sum().backward()
    assert embedding.weight.grad is not None and bool((embedding.weight.grad.abs().sum(1) > 0).all())


def test_an_unclustered_embedding_keeps_transformers_tie(tied_dir):
    model = AutoModelForCausalLM.from_pretrained(tied_dir, quantization_config=DKMConfig(bits=3))
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight
