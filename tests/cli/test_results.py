"""hf_llmkit.cli.results: parameters counted once per storage, perplexity, the results table."""

from __future__ import annotations

import math

import pytest
import torch

from hf_llmkit.cli.results import count_parameters, perplexity, results_table
from hf_llmkit.testing import tiny_llama


def test_weights_sharing_a_storage_are_counted_once():
    model = tiny_llama()
    total, trainable = count_parameters(model)
    assert total == trainable == sum(p.numel() for p in model.parameters())
    # tied as two Parameter objects over one storage (what a manual tie or some loaders produce)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.data)
    assert count_parameters(model)[0] == total - model.lm_head.weight.numel()
    model.model.embed_tokens.weight.requires_grad_(False)
    assert count_parameters(model)[1] == total - 2 * model.lm_head.weight.numel()  # the first holder decides


def test_bitsandbytes_4bit_weights_count_as_weights(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_llama().save_pretrained(tmp_path)
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=BitsAndBytesConfig(load_in_4bit=True)
    )
    assert count_parameters(quantized)[0] == count_parameters(tiny_llama())[0]


def test_perplexity_and_table():
    assert perplexity(math.log(7.0)) == pytest.approx(7.0) and perplexity(1e6) == float("inf")
    results = {"parameters": 1000, "trainable_parameters": 10, "global_step": 4, "resumed_at": 4, "train_loss": 1.0,
               "eval_perplexity": 2.0, "wall_time_s": 1.0, "output_dir": "out"}  # fmt: skip
    table = results_table([("method", "LoRA")], results)
    assert "| 1,000 (10)" in table and "this run had finished: nothing left to train" in table
    assert "| eval perplexity before | -" in table
