"""`trainable_from_packed`: a model loaded from a compact DKM checkpoint made trainable again (issue 46).

Its packed layers hold no dense weight: DKM training cannot continue on them and no PEFT method can wrap them (peft's
LoRA said only "PalettizedLinear() is not supported", ours raised a TypeError, a StopIteration or advice to set an
option already set). Swapped for DKM layers whose tables are the saved ones and latent weights the decoded ones,
the model computes exactly what it did, saves the same compact checkpoint, and takes every adapter; on the packed
layers each method's refusal names the function.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_llmkit
from hf_llmkit import DKMConfig
from hf_llmkit.quantization import DKMLinear, PalettizedLinear, quantize_model, trainable_from_packed
from hf_llmkit.testing import tiny_llama

CONFIGS = {
    "per-tensor": DKMConfig(bits=3),
    "scaled-grouped": DKMConfig(bits=4, scale_block_size=16, lut_dtype="float16", granularity="per_grouped_channel",
                                group_size=8),
    "embeddings-vectors": DKMConfig(bits=2, cluster_dim=2, quantize_embeddings=True, embedding_bits=4),
}  # fmt: skip
IDS = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(0))


def _compact(tmp_path, config: DKMConfig):
    model = quantize_model(tiny_llama(tie_word_embeddings=False), config).eval()
    model.save_pretrained(tmp_path / "compact")
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_compact_checkpoint_becomes_trainable_and_computes_and_saves_what_it_did(tmp_path, name):
    logits = _compact(tmp_path, CONFIGS[name])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "compact")
    names = trainable_from_packed(model)
    assert names and all(isinstance(model.get_submodule(n), torch.nn.Linear | torch.nn.Embedding) for n in names)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, logits)
    model.save_pretrained(tmp_path / "again")
    first, again = (load_file(tmp_path / name / "model.safetensors") for name in ("compact", "again"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    model.train()
    model(input_ids=IDS, labels=IDS).loss.backward()  # DKM training continues: the latent weights get gradients
    assert all(model.get_submodule(n).weight.grad is not None for n in names)


CONFIG_OF = {
    "lora": lambda: LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    "bottleneck": lambda: hf_llmkit.BottleneckConfig(bottleneck_size=8, init_weights=False),
    "bitfit": lambda: hf_llmkit.BitFitConfig(add_missing_biases=True, init_weights=False),
    "ptuning_v2": lambda: hf_llmkit.PTuningV2Config(num_virtual_tokens=4),
}


@pytest.mark.parametrize("method", list(CONFIG_OF))
def test_every_peft_method_adapts_it_and_names_the_fix_on_packed_layers(tmp_path, method):
    _compact(tmp_path, CONFIGS["per-tensor"])
    packed = AutoModelForCausalLM.from_pretrained(tmp_path / "compact")
    with pytest.raises(ValueError, match=r"hf_llmkit\.quantization\.trainable_from_packed\(model\)") as error:
        get_peft_model(packed, CONFIG_OF[method]())
    assert method == "lora" or "\n" not in str(error.value)  # peft's own LoRA message prints the module's repr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "compact")
    trainable_from_packed(model)
    torch.manual_seed(1)
    adapted = get_peft_model(model, CONFIG_OF[method]()).eval()
    with torch.no_grad():
        expected = adapted(IDS).logits
    adapted.save_pretrained(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "compact")
    trainable_from_packed(base)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert any(isinstance(m, DKMLinear) for m in reloaded.modules())
    assert not any(isinstance(m, PalettizedLinear) for m in reloaded.modules())
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, expected)


def test_it_says_nothing_per_layer(tmp_path, caplog):
    """Found attacking issue 46: each layer warned that its latent weights restart from the hard assignment (14
    lines for a 2-layer model, advising a callback that has nothing to do with it)."""
    import logging

    _compact(tmp_path, CONFIGS["per-tensor"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "compact")
    with caplog.at_level(logging.INFO, logger="hf_llmkit"):
        assert trainable_from_packed(model)
    assert "restart from the hard assignment" not in caplog.text
    assert logging.getLogger("hf_llmkit.quantization.layers").level == logging.NOTSET  # left as it was
