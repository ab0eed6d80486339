"""The DKM engines behind one interface: each computes DKM's soft assignment (output, weight gradient, refined
centroids) equal to naive DKM in float64; `DKMConfig(engine=...)` pins one, "auto" is one documented rule, a pin
that cannot run says what to change; the eDKM shard group exists once the model is quantized."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import DKMLinear, DKMSettings, engines, quantize_model
from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.quantization.engines import naive
from hf_llmkit.testing import tiny_llama

# (engine, latent dtype, cluster_dim, tables, relative tolerance of output / weight gradient): float32 attention
# maps (naive, table) differentiate through a softmax at temperature 0.02 std, 1/tau amplifying float32 rounding
CASES = [
    ("naive", torch.float32, 1, 1, 3e-4),
    ("naive", torch.float32, 2, 4, 3e-4),
    ("bucketed", torch.float32, 1, 1, 5e-6),
    ("bucketed", torch.float32, 1, 4, 5e-6),
    ("interval", torch.float32, 1, 1, 1e-4),  # exact |w - c| (the others smooth it by DIST_EPS), float32 per weight
    ("interval", torch.float32, 1, 8, 1e-4),
    ("interval", torch.bfloat16, 1, 4, 2e-2),  # pinned: computes in float32, outputs round to 8 bits
    ("table", torch.float32, 1, 1, 3e-4),  # 32-bit weights: one row per weight ("identity")
    ("table", torch.float32, 2, 2, 3e-4),
    ("table", torch.bfloat16, 1, 1, 2e-2),  # 16-bit outputs and gradients round to 8 bits
    ("table", torch.bfloat16, 1, 4, 2e-2),
    ("table", torch.float16, 4, 1, 5e-3),
]


def _layer(engine, dtype, d, groups, rows=64, cols=96):
    torch.manual_seed(0)
    settings = DKMSettings.build(rows, groups=groups, bits=3, cluster_dim=d, engine=engine, epsilon=1e-9)
    layer = DKMLinear(cols, rows, False, settings, dtype=dtype)
    torch.nn.init.normal_(layer.weight, std=0.02)
    layer.init_centroids()
    return layer.train()


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("engine, dtype, d, groups, tol", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_engine_equals_float64_naive_dkm(engine, dtype, d, groups, tol):
    layer = _layer(engine, dtype, d, groups)
    assert engines.resolve(layer.settings, layer.weight, None) == engine
    cfg = layer.settings.config
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, layer.in_features, generator=gen).to(dtype)
    grad_y = torch.randn(5, layer.out_features, generator=gen)
    start = layer.centroids.clone()
    # the reference: naive DKM in float64 on the same weight values, tables and temperature
    w64 = layer.weight.detach().double().requires_grad_()
    vec = dkm.to_vectors(w64, groups, d)
    std = dkm.group_std(vec).double()
    out, c_ref = naive.soft_dkm(vec, start.double(), cfg.temperature * std, cfg.dkm_iters, cfg.epsilon * std)
    y_ref = x.double() @ out.reshape(w64.shape).t()
    (y_ref * grad_y.double()).sum().backward()
    y = layer(x)
    (y.float() * grad_y).sum().backward()
    assert y.dtype == dtype
    assert _rel(y, y_ref) < tol
    assert _rel(layer.weight.grad, w64.grad) < tol
    assert _rel(layer.centroids, c_ref) < 5e-6
    assert layer.weight.grad.abs().sum() > 0 and not torch.equal(layer.centroids, start)


@pytest.mark.parametrize("dtype, groups, tol", [c[1:2] + c[3:] for c in CASES if c[0] == "interval"], ids=str)
def test_the_interval_engine_on_torch_ops_equals_float64_naive_dkm(dtype, groups, tol):
    """On the CPU the interval engine runs its C kernel (tests/quantization/test_interval_kernel.py); its torch ops,
    what accelerators and machines without a C compiler run, are held to the same reference here."""
    with engines.interval_kernel.torch_ops():
        test_engine_equals_float64_naive_dkm("interval", dtype, 1, groups, tol)


def test_auto_rule():
    def pick(dtype, **options):
        settings = DKMSettings.build(8, **options)
        return engines.resolve(settings, torch.zeros(8, 8, dtype=dtype), None)

    assert pick(torch.float32) == "interval"
    assert pick(torch.float32, granularity="per_grouped_channel", group_size=1) == "interval"
    big = torch.zeros(4096, 1024)  # a table of 2**22 weights: the bucketed engine's buckets compress it
    assert engines.resolve(DKMSettings.build(4096), big, None) == "bucketed"
    assert engines.resolve(DKMSettings.build(4096, groups=2), big, None) == "interval"
    # 16-bit weights: the interval engine where its C kernel serves (it iterates over their bit patterns), else table
    sixteen = "interval" if engines.interval_kernel.available(torch.zeros(1, dtype=torch.bfloat16)) else "table"
    assert pick(torch.bfloat16) == sixteen and pick(torch.float16) == sixteen
    with engines.interval_kernel.torch_ops():
        assert pick(torch.bfloat16) == "table" and pick(torch.float16) == "table"
    assert pick(torch.float32, cluster_dim=2) == "table"
    assert pick(torch.float32, uniquify=False) == "naive"
    settings = DKMSettings.build(8)
    assert engines.resolve(settings, torch.zeros(8, 8), group=object()) == "table"  # sharded


def test_non_finite_weights_are_an_explicit_rule():
    """ "auto" computes DKM of weights holding NaN/Inf with the table engine, where NaN propagates to the loss (a
    diverged step shows as a NaN loss); a pinned bucketed engine says it cannot."""
    weight = torch.zeros(8, 8)
    weight[0, 0] = float("nan")
    assert engines.resolve(DKMSettings.build(8), weight, None) == "table"
    for engine in ("bucketed", "interval"):
        with pytest.raises(ValueError, match=rf"engine='{engine}'.*NaN/Inf.*engine='auto'"):
            engines.resolve(DKMSettings.build(8, engine=engine), weight, None)
    layer = _layer("auto", torch.float32, 1, 1, rows=16, cols=16)
    with torch.no_grad():
        layer.weight[0, 0] = float("nan")
    y = layer(torch.randn(2, 16))
    assert torch.isnan(y).any()
    y.sum().backward()


def test_engine_is_saved_and_reloaded(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_llmkit.quantization import keep_training_state

    model = quantize_model(tiny_llama(), DKMConfig(bits=3, engine="naive"))
    keep_training_state(model)  # reload the trainable layers, not the packed ones
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config.quantization_config.engine == "naive"
    layer = again.model.layers[0].mlp.up_proj
    assert isinstance(layer, DKMLinear) and layer.settings.config.engine == "naive"


def test_bad_engines_name_the_fix():
    names = r"\('auto', 'naive', 'table', 'bucketed', 'interval'\)"
    with pytest.raises(ValueError, match=r"engine must be one of " + names):
        DKMConfig(engine="fast")
    with pytest.raises(ValueError, match="does not shard: use engine='table' or shard=False"):
        DKMConfig(engine="bucketed", shard=True)
    with pytest.raises(ValueError, match="clusters scalars: use cluster_dim=1 or engine='table'"):
        DKMConfig(engine="bucketed", cluster_dim=2)
    with pytest.raises(ValueError, match="interval.*clusters scalars: use cluster_dim=1 or engine='table'"):
        DKMConfig(engine="interval", cluster_dim=2)
    with pytest.raises(ValueError, match="interval.*does not shard: use engine='table' or shard=False"):
        DKMConfig(engine="interval", shard=True)
    with pytest.raises(ValueError, match=r"cannot train 'model.layers.0.*float32 weights, these are torch.bfloat16"):
        quantize_model(tiny_llama().to(torch.bfloat16), DKMConfig(engine="bucketed"))


def test_options_are_declared_once():
    """`DKMSettings` carries the config itself (every option's one declaration) plus what the layer derives."""
    assert [f.name for f in dataclasses.fields(DKMSettings)] == ["config", "bits", "groups"]
    settings = DKMSettings.from_config(DKMConfig(embedding_bits=6, granularity="per_grouped_channel"), "embedding", 64)
    assert (settings.bits, settings.groups, settings.cluster_dim) == (6, 2, 1)


@pytest.mark.parametrize("engine", ["auto", "naive", "table", "bucketed", "interval"])
@pytest.mark.parametrize(("cluster_dim", "shard"), [(1, False), (1, True), (2, False), (2, True)])
def test_the_config_refuses_exactly_what_the_engines_cannot_do(engine, cluster_dim, shard):
    """The capability rules live in `quantization/engines` only: DKMConfig refuses a combination exactly when
    `engines.unsupported` (asked without a dtype) names a reason, and its message carries that reason."""
    from hf_llmkit.quantization import engines

    reason = engines.unsupported(engine, None, cluster_dim, shard)
    if reason is None:
        DKMConfig(engine=engine, cluster_dim=cluster_dim, shard=shard)
    else:
        with pytest.raises(ValueError, match=re.escape(reason)):
            DKMConfig(engine=engine, cluster_dim=cluster_dim, shard=shard)
