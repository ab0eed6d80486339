"""A peft-style common test matrix (peft's tests/testing_common.py patterns) for every hf_llmkit method.

Bottleneck, BitFit, P-tuning v1 and v2 run on small custom nn.Modules (where the method applies) and on the tiny
Llama: identity at init (where the method has one), random init acts, only adapter weights train, save/load round
trip with only adapter files, disable_adapter, unload, multiple adapters with set_adapter / delete_adapter, training
moves the adapter but not the base, in/out features exposed as peft's layers do, and merging (exact or refused).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file
from torch import nn
from transformers import Conv1D

from hf_llmkit import BitFitConfig, BottleneckConfig, PTuningConfig, PTuningV2Config
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


class EmbConv1D(nn.Module):
    """Embedding -> transformers Conv1D (GPT-2's transposed Linear) -> mean over tokens -> Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.conv1d = Conv1D(16, 8)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv1d(self.emb(input_ids))).mean(1))


def _seeded(cls: type[nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return cls().eval()

    return make


def _features_input(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def _ids(vocab: int, virtual: list[int], length: int) -> torch.Tensor:
    """Token ids starting with the virtual ids of both P-tuning slots (inside the vocabulary: the base reads them)."""
    ids = torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(1))
    ids[:, : len(virtual)] = torch.tensor(virtual)
    return ids


MODELS = {  # name -> (model factory, inputs)
    "mlp": (_seeded(MLP), lambda: {"X": _features_input(4, 10)}),
    "block": (_seeded(Block), lambda: {"X": _features_input(4, 6)}),
    "conv1d": (_seeded(EmbConv1D), lambda: {"input_ids": _ids(20, [12, 13, 14, 15], 6)}),
    "llama": (tiny_llama, lambda: {"input_ids": _ids(500, [494, 495, 496, 497, 498, 499], 10)}),
}


@dataclass(frozen=True)
class Case:
    model: str
    config: Callable[[bool, int], object]  # (random_init, slot) -> config; slot k gets its own virtual tokens
    marker: str  # in the name of every adapter parameter
    identity_at_init: bool = True
    mergeable: bool = False
    slow: bool = False  # a variant proven cheaper elsewhere: `make test` (CI) runs it, `make test-fast` does not


def _bottleneck(**kw):
    return lambda random, slot: BottleneckConfig(init_weights=not random, **kw)


def _bitfit(**kw):
    return lambda random, slot: BitFitConfig(init_weights=not random, **kw)


CASES = {
    "mlp-houlsby": Case("mlp", _bottleneck(target_modules=["lin1"], bottleneck_size=4), ".bottleneck_"),
    "mlp-parallel": Case(
        "mlp", _bottleneck(target_modules=["lin1"], placement="parallel", bottleneck_size=4), ".bottleneck_"
    ),
    "block-parallel": Case(
        "block", _bottleneck(target_modules=["mlp"], placement="parallel", reduction_factor=4), ".bottleneck_"
    ),
    "conv1d-houlsby": Case("conv1d", _bottleneck(target_modules=["conv1d"], bottleneck_size=4), ".bottleneck_"),
    "mlp-bitfit": Case("mlp", _bitfit(), ".bitfit_", mergeable=True),
    "mlp-bitfit-subset": Case("mlp", _bitfit(target_modules=["lin0", "norm"]), ".bitfit_", mergeable=True),
    "conv1d-bitfit": Case("conv1d", _bitfit(target_modules=["conv1d"]), ".bitfit_", mergeable=True),
    "conv1d-ptuning": Case(
        "conv1d",
        lambda random, slot: PTuningConfig(
            num_virtual_tokens=2, target_modules=["emb"], virtual_token_start_id=12 + 2 * slot
        ),
        ".ptuning_encoder.",
        identity_at_init=False,
    ),
    "llama-houlsby": Case("llama", _bottleneck(bottleneck_size=8), ".bottleneck_"),
    "llama-pfeiffer": Case(
        "llama", _bottleneck(placement="pfeiffer", non_linearity="gelu"), ".bottleneck_", slow=True
    ),
    "llama-parallel": Case("llama", _bottleneck(placement="parallel", dropout=0.1), ".bottleneck_", slow=True),
    "llama-bitfit": Case("llama", _bitfit(add_missing_biases=True), ".bitfit_", mergeable=True),
    "llama-ptuning": Case(
        "llama",
        lambda random, slot: PTuningConfig(num_virtual_tokens=3, virtual_token_start_id=494 + 3 * slot),
        ".ptuning_encoder.",
        identity_at_init=False,
    ),
    "llama-ptuning_v2": Case(
        "llama", lambda random, slot: PTuningV2Config(num_virtual_tokens=3), ".ptuning_v2_prefix.", False
    ),
}


def _cases(keep: Callable[[Case], bool] = lambda case: True) -> list:
    marks = {True: [pytest.mark.slow], False: []}
    return [pytest.param(name, marks=marks[c.slow], id=name) for name, c in CASES.items() if keep(c)]


IDS = _cases()


def _setup(case: str, *, random: bool = False, slot: int = 0):
    spec = CASES[case]
    make_model, make_input = MODELS[spec.model]
    return make_model, make_input(), spec.config(random, slot)


def _out(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out


def _adapter_names(model, case: str) -> set[str]:
    return {n for n, _ in model.named_parameters() if CASES[case].marker in n}


@pytest.mark.parametrize("case", _cases(lambda c: c.identity_at_init))
def test_identity_at_init(case):
    make_model, inputs, config = _setup(case)
    adapted = _out(get_peft_model(make_model(), config), inputs)
    torch.testing.assert_close(adapted, _out(make_model(), inputs), rtol=0, atol=0)


@pytest.mark.parametrize("case", IDS)
def test_random_init_acts(case):
    make_model, inputs, config = _setup(case, random=True)
    assert not torch.allclose(
        _out(get_peft_model(make_model(), config), inputs), _out(make_model(), inputs), atol=1e-4
    )


@pytest.mark.parametrize("case", IDS)
def test_only_adapter_weights_train(case, capsys):
    make_model, _, config = _setup(case)
    model = get_peft_model(make_model(), config)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and trainable == _adapter_names(model, case)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model.print_trainable_parameters()
    assert f"trainable params: {n_trainable:,}" in capsys.readouterr().out
    assert model.get_nb_trainable_parameters()[0] == n_trainable


@pytest.mark.parametrize("case", IDS)
def test_save_load_round_trip_writes_only_the_adapter(case, tmp_path):
    make_model, inputs, config = _setup(case, random=True)
    model = get_peft_model(make_model(), config)
    expected = _out(model, inputs)
    model.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files)
    assert not [f for f in files if f.endswith((".bin", ".pt")) or f.startswith("model")], files
    state = load_file(tmp_path / "adapter_model.safetensors")
    assert state and all(t.numel() > 0 for t in state.values())
    assert all(CASES[case].marker in k for k in state), list(state)
    reloaded = PeftModel.from_pretrained(make_model(), tmp_path)
    assert type(reloaded.peft_config["default"]) is type(config)
    torch.testing.assert_close(_out(reloaded, inputs), expected, rtol=0, atol=0)
    # adapter weights created on the meta device, then loaded (peft's low_cpu_mem_usage path). They stay views of
    # the memory-mapped file, not 64-byte aligned, so CPU matmuls may take another kernel: equal to float rounding.
    lazily = PeftModel.from_pretrained(make_model(), tmp_path, low_cpu_mem_usage=True)
    torch.testing.assert_close(_out(lazily, inputs), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", IDS)
def test_disable_adapter_and_unload_give_the_base_model(case):
    make_model, inputs, config = _setup(case, random=True)
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
    make_model, inputs, config = _setup(case, random=True)
    _, _, other = _setup(case, random=True, slot=1)
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
    adapters = _adapter_names(model, case)
    assert all(p.requires_grad == (".other" in n) for n, p in model.named_parameters() if n in adapters)
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


def _features(base: nn.Module) -> tuple[int, int]:
    """The (in, out) a peft layer reports for `base`, worked out from the module itself."""
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    if isinstance(base, Conv1D):
        return base.weight.shape[0], base.weight.shape[1]  # weight is [in, out]
    if isinstance(base, nn.LayerNorm):
        return base.normalized_shape[0], base.normalized_shape[0]
    if isinstance(base, nn.Embedding):
        return base.num_embeddings, base.embedding_dim
    if hasattr(base, "layer_idx"):  # an attention module: hidden states in, hidden states out
        return base.config.hidden_size, base.config.hidden_size
    linears = [m for m in base.modules() if isinstance(m, nn.Linear)]  # a block: its first input, its last output
    return linears[0].in_features, linears[-1].out_features


@pytest.mark.parametrize("case", IDS)
def test_in_features_out_features_exposed(case):
    """peft's test_in_features_out_features_exposed: every tuner layer reports its base layer's in/out features."""
    make_model, _, config = _setup(case)
    layers = [m for m in get_peft_model(make_model(), config).modules() if isinstance(m, BaseTunerLayer)]
    assert layers
    for layer in layers:
        assert (layer.in_features, layer.out_features) == _features(layer.get_base_layer()), type(layer).__name__


@pytest.mark.parametrize("case", _cases(lambda c: c.mergeable))
def test_merge_and_unload_is_exact(case):
    make_model, inputs, config = _setup(case, random=True)
    model = get_peft_model(make_model(), config)
    expected = _out(model, inputs)
    merged = model.merge_and_unload()
    assert not any(isinstance(m, BaseTunerLayer) for m in merged.modules())
    torch.testing.assert_close(_out(merged, inputs), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", _cases(lambda c: c.mergeable))
def test_merge_unmerge_round_trip(case):
    make_model, inputs, config = _setup(case, random=True)
    base_out = _out(make_model(), inputs)
    model = get_peft_model(make_model(), config)
    expected = _out(model, inputs)
    model.merge_adapter()
    torch.testing.assert_close(_out(model, inputs), expected, rtol=1e-6, atol=1e-6)
    model.unmerge_adapter()
    torch.testing.assert_close(_out(model, inputs), expected, rtol=1e-6, atol=1e-6)
    with model.disable_adapter():
        torch.testing.assert_close(_out(model, inputs), base_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", _cases(lambda c: not c.mergeable))
def test_merge_is_refused_and_names_the_alternative(case):
    make_model, inputs, config = _setup(case, random=True)
    model = get_peft_model(make_model(), config)
    expected = _out(model, inputs)
    snapshot = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"unload\(\)"):
        model.merge_and_unload()
    with pytest.raises(ValueError, match="cannot (be )?merge"):
        model.merge_adapter()
    # the failed merge changed nothing
    assert all(torch.equal(snapshot[k], v) for k, v in model.state_dict().items())
    torch.testing.assert_close(_out(model, inputs), expected, rtol=0, atol=0)
