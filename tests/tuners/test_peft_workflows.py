"""The peft workflows a user runs with BottleneckConfig / BitFitConfig: the HF Trainer (with gradient checkpointing), a
bitsandbytes 4-bit nf4 base; and DeepSpeed ZeRO-3 saving for every method. (Reloading in a fresh process and the rest
of peft's adapter lifecycle: the battery in test_lifecycle.py / test_lifecycle_saving.py.)"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file

from hf_llmkit import BitFitConfig, BottleneckConfig
from hf_llmkit.testing import tiny_llama
from tests.tuners.support import METHODS, examples, quantized_tiny_llama, run_zero3, trainer

CONFIGS = {
    "houlsby": lambda: BottleneckConfig(bottleneck_size=8, init_weights=False),
    "parallel": lambda: BottleneckConfig(placement="parallel", reduction_factor=4, init_weights=False),
    "bitfit": lambda: BitFitConfig(add_missing_biases=True, init_weights=False),
}


@pytest.mark.parametrize("name", ["houlsby", "bitfit"])
def test_trainer_trains_with_gradient_checkpointing_and_saves_only_the_adapter(name, tmp_path):
    config = CONFIGS[name]()
    config.init_weights = True
    model = get_peft_model(tiny_llama(), config)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    data = examples(16, length=16)
    run = trainer(
        model, data, tmp_path / "run", per_device_train_batch_size=4, learning_rate=5e-3, logging_steps=1,
        activation_checkpointing=True,
    )  # fmt: skip
    result = run.train()
    assert model.get_base_model().is_activation_checkpointing
    losses = [log["loss"] for log in run.state.log_history if "loss" in log]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses))) and result.global_step == 4
    assert all(torch.equal(base_before[n], p) for n, p in model.named_parameters() if n in base_before)
    run.save_model(str(tmp_path / "adapter"))
    state = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert all(".bottleneck_" in k or ".bitfit_" in k for k in state)
    moved = [k for k, v in state.items() if ("bottleneck_up" in k or "bitfit_bias" in k) and v.abs().sum() > 0]
    assert moved, "training left the zero-initialised adapter weights at zero"
    assert not (tmp_path / "adapter" / "model.safetensors").exists()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_4bit_nf4_base(name, tmp_path):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    model = quantized_tiny_llama(tmp_path / "base")
    assert isinstance(model.model.layers[0].mlp.down_proj, bnb.nn.Linear4bit)
    inputs = torch.randint(3, 500, (2, 8))
    with torch.no_grad():
        base = model(input_ids=inputs).logits
    config = CONFIGS[name]()
    config.init_weights = True
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=inputs).logits, base, rtol=0, atol=0)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        loss = peft_model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        trained = peft_model(input_ids=inputs).logits
    assert not torch.allclose(trained, base)
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(quantized_tiny_llama(tmp_path / "base2"), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=inputs).logits, trained, rtol=0, atol=0)
        if name == "bitfit":  # the biases fold into the 4-bit layers exactly: only the float bias changes
            merged = reloaded.merge_and_unload()
            assert isinstance(merged.model.layers[0].mlp.down_proj, bnb.nn.Linear4bit)
            torch.testing.assert_close(merged(input_ids=inputs).logits, trained, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def zero3_results(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return run_zero3(tmp_path_factory.mktemp("zero3"))


@pytest.mark.parametrize("name", list(METHODS))
def test_deepspeed_zero3_saves_complete_adapter_weights(zero3_results, name):
    """One ZeRO-3 run (a base partitioned by zero.Init) trains and saves every method: no 0-sized or zero shards."""
    result = zero3_results[name]
    assert result["partitioned"], "the base model was not partitioned: the test would prove nothing"
    assert "adapter_model.safetensors" in result["files"] and "model.safetensors" not in result["files"]
    reference = get_peft_model(tiny_llama(), METHODS[name]())
    expected = {k.replace(".default", ""): tuple(p.shape) for k, p in reference.named_parameters() if p.requires_grad}
    saved = result["saved"]
    assert expected and {k: tuple(saved[k].shape) for k in expected if k in saved} == expected
    assert all(saved[k].numel() > 0 and saved[k].abs().sum() > 0 for k in expected)  # gathered, trained
    extra = set(saved) - set(expected)  # P-tuning v2 also saves the folded prefixes inference uses
    assert all(k.endswith(".ptuning_v2_prefix.prefix") for k in extra), sorted(extra)
