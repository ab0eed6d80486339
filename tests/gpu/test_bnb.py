"""bitsandbytes 4-bit NF4 bases on CUDA with every hf_llmkit PEFT method: a bf16 Trainer run changes only the
adapter (the packed 4-bit weights stay as loaded), and the saved adapter reloads onto a fresh 4-bit base with
identical outputs.

CPU counterparts: each method's `test_on_a_bitsandbytes_4bit_base` in tests/tuners/ (bitsandbytes' CPU backend).
"""

from __future__ import annotations

import math

import pytest
import torch
from peft import PeftModel, get_peft_model

from hf_llmkit.testing import tiny_llama
from tests.tuners.support import METHODS, examples, trainer

pytestmark = pytest.mark.gpu


def quantized_on_cuda(folder):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if not (folder / "config.json").exists():
        tiny_llama().save_pretrained(folder)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, device_map={"": 0})


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_trains_and_reloads_on_a_4bit_cuda_base(tmp_path, method):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    virtual = 3 if method == "ptuning" else 0
    base = quantized_on_cuda(tmp_path / "base")
    packed = [(m, m.weight.detach().clone()) for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert packed and all(w.device.type == "cuda" and w.dtype == torch.uint8 for _, w in packed)
    torch.manual_seed(0)
    model = get_peft_model(base, METHODS[method]())
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    run = trainer(model, examples(8, virtual=virtual), tmp_path / "run", max_steps=3, use_cpu=False, bf16=True)
    assert math.isfinite(run.train().training_loss)
    after = dict(model.named_parameters())
    assert any(not torch.equal(before[n], after[n].detach()) for n in before)  # the adapter learned
    for module, weight in packed:  # the frozen 4-bit base is untouched (the same modules, wrapped or not)
        torch.testing.assert_close(module.weight, weight, rtol=0, atol=0)
    model.save_pretrained(tmp_path / "adapter")
    batch = {key: value[None].cuda() for key, value in examples(1, virtual=virtual, seed=1)[0].items()}
    with torch.no_grad():
        expected = model.eval()(**batch).logits  # still under accelerate's bf16 autocast: Trainer leaves it wrapped
        reloaded = PeftModel.from_pretrained(quantized_on_cuda(tmp_path / "base"), tmp_path / "adapter").eval()
        with torch.autocast("cuda", dtype=torch.bfloat16):  # the same autocast (measured: fp32 differs by ~3e-3)
            logits = reloaded(**batch).logits.float()
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
