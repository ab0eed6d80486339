"""DKM's centroid update weighted by a calibrated importance (issue 50, item 2): every weight counts its input
feature's energy `H_jj` times its block scale squared, `C <- A^T H W / A^T H 1`, as `calibrate`'s refit counts it. The
interval engine (its C kernel and its torch ops) and the naive one equal that formula written out in float64 autograd
(outputs, weight and input gradients, refined tables); a uniform importance is today's unweighted update bit for bit;
the engines that cannot weigh refuse in one line; the kernel saves nothing per weight for it; the importance travels
with a Trainer checkpoint, and one without it loads as uniform."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import (
    DKMLinear,
    DKMSettings,
    DKMTrainingStateCallback,
    keep_training_state,
    quantize_model,
)
from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.quantization.engines import interval_kernel as kernel
from hf_llmkit.testing import tiny_llama
from tests.quantization.test_interval_kernel import _step


def _layer(groups=1, bits=3, rows=48, cols=64, block=0, dtype=torch.float32, **options):
    torch.manual_seed(0)
    options = {"epsilon": 1e-9, "engine": "interval", **options}
    settings = DKMSettings.build(rows, groups=groups, bits=bits, scale_block_size=block, **options)
    layer = DKMLinear(cols, rows, False, settings, dtype=dtype)
    torch.nn.init.normal_(layer.weight, std=0.02)
    with torch.no_grad():
        layer.weight[:, : cols // 8] *= 6  # a few wide blocks: the scales differ
    layer.init_centroids()
    gen = torch.Generator().manual_seed(4)
    importance = torch.rand(cols, generator=gen).pow(4) * 10  # heavy-tailed, as input energies are
    importance[::7] = 0  # dead features count nothing
    layer.importance = importance
    return layer.train()


def _reference(layer, x, grad_y, start):
    """(y, d/dw, d/dx, refined table) of the weighted update written out in float64: attention
    `softmax(-|w/s - c| / tau)`, `c <- sum_i a h w / sum_i a h` with `h = importance[col] s^2`."""
    cfg, groups = layer.settings.config, layer.settings.groups
    w = layer.weight.detach().double().requires_grad_()
    xd = x.detach().double().requires_grad_()
    rows, cols = w.shape
    spread = torch.ones_like(w) if layer.scales is None else dkm.expand_scales(layer.scales.double(), cols)
    v = (w / spread).reshape(groups, -1, 1)  # [G, n, 1]
    h = (layer.importance.double().expand(rows, -1) * spread.square()).reshape(groups, -1, 1)
    std = v.detach().reshape(groups, -1).std(1, unbiased=False).view(-1, 1, 1)
    tau, eps = cfg.temperature * std, cfg.epsilon * std.view(-1)
    c = start.double().transpose(1, 2)  # [G, 1, K]
    for _ in range(cfg.dkm_iters):
        a = torch.softmax(-(v - c).abs() / tau, dim=-1)  # [G, n, K]
        new = ((a * h * v).sum(1) / (a * h).sum(1)).unsqueeze(1)
        done = bool(((new - c).abs().amax(dim=(1, 2)) <= eps).all())
        c = new
        if done:
            break
    a = torch.softmax(-(v - c).abs() / tau, dim=-1)
    w_c = (a * c).sum(-1).reshape(rows, cols) * spread
    y = xd @ w_c.t()
    (y * grad_y.double()).sum().backward()
    return y, w.grad, xd.grad, c.transpose(1, 2)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


CASES = {  # (tables, bits, scale block, engine, tolerance: the C kernel's; torch's float32 ops at least 1e-4)
    "one table": (1, 3, 0, "interval", 1e-5),
    "scales per 16 inputs": (1, 3, 16, "interval", 1e-5),
    # 64 weights a table, heavy-tailed importance: an entry held by a few weights of little weight is ill-conditioned
    # (4e-6 for the weight gradient with importance 1 here)
    "a table per channel, scales": (48, 2, 32, "interval", 5e-4),
    "2 tables, naive": (2, 3, 16, "naive", 1e-4),
}


@pytest.mark.parametrize("case", CASES)
def test_the_weighted_update_equals_its_formula_in_float64(case):
    """The C kernel and the torch ops of the interval engine (and the naive engine) against the formula: outputs,
    weight and input gradients (through the iterations), refined tables; the weighing moved the tables."""
    groups, bits, block, engine, tol = CASES[case]
    layer = _layer(groups, bits, block=block, engine=engine, dkm_iters=3)
    gen = torch.Generator().manual_seed(1)
    x, grad_y = torch.randn(5, 64, generator=gen), torch.randn(5, 48, generator=gen)
    start = layer.centroids.clone()
    want = _reference(layer, x, grad_y, start)
    for torch_ops, bound in ((False, tol), (True, max(tol, 1e-4))):
        got = _step(layer, x, grad_y, start, torch_ops)
        for name, g, w in zip(("output", "weight gradient", "input gradient", "table"), got, want):
            assert _rel(g, w) < bound, name
    layer.importance = None
    unweighted = _step(layer, x, grad_y, start)
    assert _rel(unweighted[3], want[3]) > 100 * tol  # the importance changed the update


@pytest.mark.parametrize("block", [0, 16], ids=["no scales", "scales"])
def test_a_uniform_importance_is_the_unweighted_update_bit_for_bit(block):
    """Importance 1 everywhere (without scales: each weight counts 1) and no importance (today's update) give the same
    outputs, gradients and tables bit for bit, in the kernel and in the torch ops; with scales, importance 1 counts
    each weight by its scale squared, and no importance stays the unweighted update (so does `dkm_iters=0`, where the
    importance is not even passed on)."""
    layer = _layer(block=block, dkm_iters=3)
    gen = torch.Generator().manual_seed(2)
    x, grad_y = torch.randn(4, 64, generator=gen), torch.randn(4, 48, generator=gen)
    start = layer.centroids.clone()
    for torch_ops in (False, True):
        layer.importance = None
        plain = _step(layer, x, grad_y, start, torch_ops)
        layer.importance = torch.ones(64)
        ones = _step(layer, x, grad_y, start, torch_ops)
        same = [torch.equal(a, b) for a, b in zip(plain, ones)]
        assert same == [not block] * 4 if block else same == [True] * 4
    layer.settings = DKMSettings.build(48, bits=3, scale_block_size=block, engine="interval", dkm_iters=0)
    layer.importance = None
    plain = _step(layer, x, grad_y, start)
    layer.importance = torch.rand(64)
    assert all(torch.equal(a, b) for a, b in zip(plain, _step(layer, x, grad_y, start)))


@pytest.mark.parametrize("engine", ["table", "bucketed"])
def test_engines_that_cannot_weigh_refuse_in_one_line(engine):
    layer = _layer(engine=engine, dkm_iters=3)
    with pytest.raises(ValueError, match=rf"engine='{engine}'\) does not weigh.*engine='interval'.*dkm_iters=0") as e:
        layer(torch.randn(2, 64))
    assert "\n" not in str(e.value)
    layer.importance = None  # uniform: as before
    layer(torch.randn(2, 64)).sum().backward()


class _Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.rows = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _trainer(model, out, steps):
    args = TrainingArguments(str(out), max_steps=steps, save_steps=1, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], disable_tqdm=True, seed=0)  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=_Rows(), callbacks=[DKMTrainingStateCallback()])


def _importance(model) -> dict[str, torch.Tensor | None]:
    return {n: m.importance for n, m in model.named_modules() if isinstance(m, DKMLinear)}


def test_the_importance_travels_with_a_trainer_checkpoint(tmp_path):
    """`calibrate` (here the calibrated recipe's, before the first step) keeps each layer's input energy `[in]`; a
    Trainer checkpoint holds it and a resumed run gets it back bit for bit (it does not calibrate again), so DKM's
    iterations on that start run weighted; a checkpoint without it loads as uniform, where a calibrated start refuses
    the iterations in one line; the compact model carries none."""
    config = DKMConfig(bits=3, recipe="calibrated", scale_block_size=16, calibration_samples=4)
    torch.manual_seed(0)
    first = quantize_model(tiny_llama(), config)
    assert set(_importance(first).values()) == {None}
    _trainer(first, tmp_path, 1).train()
    kept = _importance(first)
    layers = {n: m for n, m in first.named_modules() if isinstance(m, DKMLinear)}
    assert all(kept[n].shape == (m.in_features,) and kept[n].dtype == torch.float32 for n, m in layers.items())
    saved = load_file(tmp_path / "checkpoint-1" / "model.safetensors")
    assert all(torch.equal(saved[f"{n}.importance"], v) for n, v in kept.items())
    resumed = quantize_model(tiny_llama(seed=1), config)
    _trainer(resumed, tmp_path, 2).train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert all(torch.equal(v, kept[n]) for n, v in _importance(resumed).items())
    ids = _Rows().rows[:2]
    soft = DKMConfig(bits=3, scale_block_size=16, dkm_iters=3, training_forward="soft")
    weighted = quantize_model(tiny_llama(seed=1), soft)
    weighted.load_state_dict(saved, strict=False)  # a training checkpoint, as a Trainer resume loads it
    assert {m.start for m in weighted.modules() if isinstance(m, DKMLinear)} == {"calibrated"}
    keep_training_state(weighted, False)
    weighted.train()(input_ids=ids, labels=ids).loss.backward()  # the iterations run, weighted
    old = quantize_model(tiny_llama(seed=1), soft)
    old.load_state_dict({k: v for k, v in saved.items() if not k.endswith(".importance")}, strict=False)
    assert set(_importance(old).values()) == {None}
    keep_training_state(old, False)
    with pytest.raises(ValueError, match=r"no input importance.*calibrate on the model again.*dkm_iters=0") as e:
        old.train()(input_ids=ids, labels=ids)
    assert "\n" not in str(e.value)
    first.save_pretrained(tmp_path / "compact")  # after train(): compact
    assert not any(k.endswith(".importance") for k in load_file(tmp_path / "compact" / "model.safetensors"))


def _saved_bytes(layer, x) -> int:
    """Bytes of the storages autograd keeps for backward, the layer input and the weight left out."""
    skip = {x.untyped_storage().data_ptr(), layer.weight.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer.dkm_step = None
        layer(x)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32, scales", "bfloat16"])
def test_the_weighted_kernel_saves_nothing_per_weight_for_backward(dtype):
    """Weighted, the kernel keeps what it kept (the table's trajectory, the scales) and the importance `[in]`; 16-bit
    weights run per weight there (a pattern's weights count differently), still saving nothing per weight."""
    block = 0 if dtype == torch.bfloat16 else 64
    layer = _layer(rows=512, cols=256, block=block, dtype=dtype, dkm_iters=3, offload=False)
    x = torch.randn(4, 256).to(dtype)
    known = layer.importance.nbytes + (0 if layer.scales is None else layer.scales.nbytes)
    assert _saved_bytes(layer, x) - known < 4096


def test_the_weighted_loops_and_thread_counts_agree():
    """Weighted, the kernel's loops (AVX2 where the CPU has it, portable) agree within float32 rounding, and 1 and 2
    threads bit for bit (partial sums per fixed chunk of weights)."""
    layer = _layer(rows=128, cols=192, block=64, dkm_iters=3)
    gen = torch.Generator().manual_seed(3)
    x, grad_y = torch.randn(4, 192, generator=gen), torch.randn(4, 128, generator=gen)
    start, threads = layer.centroids.clone(), torch.get_num_threads()
    levels = kernel.LOOPS[: kernel.LOOPS.index(kernel.loops()) + 1]
    runs = {}
    try:
        for level in levels:
            kernel.cap_loops(level)
            for n in (1, 2):
                torch.set_num_threads(n)
                runs[level, n] = _step(layer, x, grad_y, start)
    finally:
        torch.set_num_threads(threads)
        kernel.cap_loops(kernel.LOOPS[-1])
    for level in levels:
        assert all(torch.equal(a, b) for a, b in zip(runs[level, 1], runs[level, 2]))
        assert all(_rel(a, b) < 1e-5 for a, b in zip(runs[level, 1], runs[levels[0], 1]))
