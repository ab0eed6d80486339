"""A peft-style common test matrix (peft's tests/testing_common.py patterns) for BottleneckConfig and BitFitConfig.

Every case runs on small custom nn.Modules and on the tiny Llama: identity at init, random init acts, only adapter
weights train, save/load round trip with only adapter files, disable_adapter, unload, multiple adapters with
set_adapter / delete_adapter, training moves the adapter but not the base, and merging (exact or refused).
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file
from torch import nn

from hf_llmkit import BitFitConfig, BottleneckConfig
from hf_llmkit.testing import tiny_llama


class MLP(nn.Module):
    """Linear -> ReLU -> Linear -> LayerNorm -> Linear head (names as peft's own test MLP uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Linear(10, 20)
        self.relu = nn.ReLU()
        self.lin1 = nn.Linear(20, 20)
        self.norm = nn.LayerNorm(20)
        self.lin2 = nn.Linear(20, 2, bias=False)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.norm(self.lin1(self.relu(self.lin0(X)))))


class Block(nn.Module):
    """A residual block with an inner MLP module, the shape a parallel adapter wraps."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        h = self.emb(X)
        return self.head(h + self.mlp(h))


def _mlp():
    torch.manual_seed(0)
    return MLP().eval()


def _block():
    torch.manual_seed(0)
    return Block().eval()


def _mlp_input():
    return {"X": torch.randn(4, 10, generator=torch.Generator().manual_seed(1))}


def _block_input():
    return {"X": torch.randn(4, 6, generator=torch.Generator().manual_seed(1))}


def _llama_input():
    return {"input_ids": torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(1))}


MODELS = {"mlp": (_mlp, _mlp_input), "block": (_block, _block_input), "llama": (tiny_llama, _llama_input)}

# (model, config factory taking **overrides)
CASES = {
    "mlp-houlsby": ("mlp", lambda **kw: BottleneckConfig(target_modules=["lin1"], bottleneck_size=4, **kw)),
    "mlp-parallel": (
        "mlp",
        lambda **kw: BottleneckConfig(target_modules=["lin1"], placement="parallel", bottleneck_size=4, **kw),
    ),
    "block-parallel": (
        "block",
        lambda **kw: BottleneckConfig(target_modules=["mlp"], placement="parallel", reduction_factor=4, **kw),
    ),
    "mlp-bitfit": ("mlp", lambda **kw: BitFitConfig(**kw)),
    "mlp-bitfit-subset": ("mlp", lambda **kw: BitFitConfig(target_modules=["lin0", "norm"], **kw)),
    "llama-houlsby": ("llama", lambda **kw: BottleneckConfig(bottleneck_size=8, **kw)),
    "llama-pfeiffer": ("llama", lambda **kw: BottleneckConfig(placement="pfeiffer", non_linearity="gelu", **kw)),
    "llama-parallel": ("llama", lambda **kw: BottleneckConfig(placement="parallel", dropout=0.1, **kw)),
    "llama-bitfit": ("llama", lambda **kw: BitFitConfig(add_missing_biases=True, **kw)),
}
IDS = list(CASES)


def _setup(case: str, **overrides):
    model_name, make_config = CASES[case]
    make_model, make_input = MODELS[model_name]
    return make_model, make_input(), make_config(**overrides)


def _out(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out


def _adapter_names(model) -> set[str]:
    return {n for n, _ in model.named_parameters() if ".bottleneck_" in n or ".bitfit_" in n}


@pytest.mark.parametrize("case", IDS)
def test_identity_at_init_and_random_init_acts(case):
    make_model, inputs, config = _setup(case)
    base_out = _out(make_model(), inputs)
    torch.testing.assert_close(_out(get_peft_model(make_model(), config), inputs), base_out, rtol=0, atol=0)
    _, _, random_config = _setup(case, init_weights=False)
    assert not torch.allclose(_out(get_peft_model(make_model(), random_config), inputs), base_out, atol=1e-4)


@pytest.mark.parametrize("case", IDS)
def test_only_adapter_weights_train(case, capsys):
    make_model, _, config = _setup(case)
    model = get_peft_model(make_model(), config)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and trainable == _adapter_names(model)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model.print_trainable_parameters()
    assert f"trainable params: {n_trainable:,}" in capsys.readouterr().out
    assert model.get_nb_trainable_parameters()[0] == n_trainable


@pytest.mark.parametrize("case", IDS)
def test_save_load_round_trip_writes_only_the_adapter(case, tmp_path):
    make_model, inputs, config = _setup(case, init_weights=False)
    model = get_peft_model(make_model(), config)
    expected = _out(model, inputs)
    model.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files)
    assert not [f for f in files if f.endswith((".bin", ".pt")) or f.startswith("model")], files
    state = load_file(tmp_path / "adapter_model.safetensors")
    assert state and all(t.numel() > 0 for t in state.values())
    assert all(".bottleneck_" in k or ".bitfit_" in k for k in state), list(state)
    reloaded = PeftModel.from_pretrained(make_model(), tmp_path)
    assert type(reloaded.peft_config["default"]) is type(config)
    torch.testing.assert_close(_out(reloaded, inputs), expected, rtol=0, atol=0)
    # adapter weights created on the meta device, then loaded (peft's low_cpu_mem_usage path)
    lazily = PeftModel.from_pretrained(make_model(), tmp_path, low_cpu_mem_usage=True)
    torch.testing.assert_close(_out(lazily, inputs), expected, rtol=0, atol=0)


@pytest.mark.parametrize("case", IDS)
def test_disable_adapter_and_unload_give_the_base_model(case):
    make_model, inputs, config = _setup(case, init_weights=False)
    base_out = _out(make_model(), inputs)
    model = get_peft_model(make_model(), config)
    adapted = _out(model, inputs)
    with model.disable_adapter():
        torch.testing.assert_close(_out(model, inputs), base_out, rtol=0, atol=0)
    torch.testing.assert_close(_out(model, inputs), adapted, rtol=0, atol=0)
    unloaded = model.unload()
    assert not any(isinstance(m, BaseTunerLayer) for m in unloaded.modules())
    assert not hasattr(unloaded, "peft_config")
    torch.testing.assert_close(_out(unloaded, inputs), base_out, rtol=0, atol=0)


@pytest.mark.parametrize("case", IDS)
def test_multiple_adapters_set_adapter_and_delete(case):
    make_model, inputs, config = _setup(case, init_weights=False)
    _, _, other = _setup(case, init_weights=False)
    model = get_peft_model(make_model(), config)
    out_default = _out(model, inputs)
    torch.manual_seed(123)
    model.add_adapter("other", other)
    # adding an adapter neither activates it nor makes it trainable
    torch.testing.assert_close(_out(model, inputs), out_default, rtol=0, atol=0)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".other" in n)
    model.set_adapter("other")
    out_other = _out(model, inputs)
    assert not torch.allclose(out_other, out_default)
    assert all(p.requires_grad == (".other" in n) for n, p in model.named_parameters() if n in _adapter_names(model))
    model.set_adapter("default")
    torch.testing.assert_close(_out(model, inputs), out_default, rtol=0, atol=0)
    model.delete_adapter("other")
    assert not any(".other" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(_out(model, inputs), out_default, rtol=0, atol=0)


@pytest.mark.parametrize("case", IDS)
def test_training_moves_the_adapter_not_the_base(case):
    make_model, inputs, config = _setup(case)
    model = get_peft_model(make_model(), config)
    model.train()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        out = model(**inputs)
        loss = out.logits.float().pow(2).mean() if hasattr(out, "logits") else out.pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)
    assert all(torch.equal(frozen[n], p) for n, p in model.named_parameters() if n in frozen)


@pytest.mark.parametrize("case", [c for c in IDS if "bitfit" in c])
def test_bitfit_merge_and_unload_is_exact(case):
    make_model, inputs, config = _setup(case, init_weights=False)
    model = get_peft_model(make_model(), config)
    expected = _out(model, inputs)
    merged = model.merge_and_unload()
    assert not any(isinstance(m, BaseTunerLayer) for m in merged.modules())
    torch.testing.assert_close(_out(merged, inputs), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", [c for c in IDS if "bitfit" in c])
def test_bitfit_merge_unmerge_round_trip(case):
    make_model, inputs, config = _setup(case, init_weights=False)
    base_out = _out(make_model(), inputs)
    model = get_peft_model(make_model(), config)
    expected = _out(model, inputs)
    model.merge_adapter()
    torch.testing.assert_close(_out(model, inputs), expected, rtol=1e-6, atol=1e-6)
    model.unmerge_adapter()
    torch.testing.assert_close(_out(model, inputs), expected, rtol=1e-6, atol=1e-6)
    with model.disable_adapter():
        torch.testing.assert_close(_out(model, inputs), base_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", [c for c in IDS if "bitfit" not in c])
def test_bottleneck_merge_is_refused_and_names_the_alternative(case):
    make_model, inputs, config = _setup(case, init_weights=False)
    model = get_peft_model(make_model(), config)
    expected = _out(model, inputs)
    snapshot = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"unload\(\)"):
        model.merge_and_unload()
    with pytest.raises(ValueError, match="cannot be merged"):
        model.merge_adapter()
    # the failed merge changed nothing
    assert all(torch.equal(snapshot[k], v) for k, v in model.state_dict().items())
    torch.testing.assert_close(_out(model, inputs), expected, rtol=0, atol=0)
