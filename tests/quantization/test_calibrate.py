"""`calibrate`: GPTQ's error-compensated rounding onto DKM's tables. With uncorrelated inputs it is nearest-entry
rounding; with correlated ones it lowers the layer's output error; `DKMConfig(calibration_samples=N)` ends a Trainer
run with it (and a run resumed from a checkpoint ends with the same bits: tests/quantization/test_training_state.py
runs with it on); bad uses name the fix."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import DKMLinear, DKMTrainingStateCallback, calibrate, quantize_model
from hf_llmkit.quantization import _dkm as dkm
from hf_llmkit.quantization.calibration import MOMENT_BYTES, _inputs, chunks, round_onto_table
from hf_llmkit.quantization.layers import DKMSettings
from hf_llmkit.testing import tiny_llama


def _nearest(w: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table.gather(1, (w.unsqueeze(2) - table.unsqueeze(1)).abs().argmin(2))


def _layer_case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 96, generator=gen) * 0.02
    table = dkm.kmeans(w.unsqueeze(-1), 8, 12, 65536)[..., 0]  # a table per row
    x = torch.randn(512, 96, generator=gen) @ (torch.eye(96) + 0.5 * torch.randn(96, 96, generator=gen))
    return w, table, x


def test_with_uncorrelated_inputs_it_is_nearest_rounding():
    w, table, _ = _layer_case()
    out = round_onto_table(w, table, torch.eye(96) * 3.0)
    assert torch.equal(out, w)


def test_with_correlated_inputs_it_lowers_the_output_error():
    w, table, x = _layer_case()
    nearest = _nearest(w, table)
    latent = round_onto_table(w, table, x.t() @ x / x.shape[0])
    rounded = _nearest(latent, table)
    assert (rounded.unsqueeze(2) == table.unsqueeze(1)).any(2).all()  # every weight on its row's table
    error = (x @ (rounded - w).t()).norm() / (x @ (nearest - w).t()).norm()
    assert error < 0.8, error


def test_with_block_scales_a_weight_rounds_onto_its_table_times_its_scale():
    w, _, x = _layer_case()
    scales = dkm.block_scales(w, 32, torch.float16)  # [64, 3]
    spread = dkm.expand_scales(scales, 96)
    table = dkm.kmeans((w / spread).reshape(1, -1, 1), 8, 12, 65536)[0, :, 0].expand(64, -1)  # one table
    out = round_onto_table(w, table, torch.eye(96) * 3.0, spread)
    assert torch.equal(out, w)  # uncorrelated inputs: nothing to compensate
    nearest = _nearest(w / spread, table) * spread
    latent = round_onto_table(w, table, x.t() @ x / x.shape[0], spread)
    rounded = _nearest(latent / spread, table) * spread  # the hard assignment of the compensated latent weight
    error = (x @ (rounded - w).t()).norm() / (x @ (nearest - w).t()).norm()
    assert error < 0.8, error


def test_calibrate_keeps_block_scales_and_rounds_onto_them():
    torch.manual_seed(0)
    model = quantize_model(tiny_llama(), DKMConfig(bits=4, scale_block_size=16, lut_dtype="float16"))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, DKMLinear)}
    before = {n: (m.scales.clone(), m.hard_weight(torch.float32).clone()) for n, m in layers.items()}
    batches = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    assert calibrate(model, batches) == 14
    for name, m in layers.items():
        scales, hard = before[name]
        assert torch.equal(m.scales, scales)  # the scales stay as trained
        unit = m.hard_weight(torch.float32) / dkm.expand_scales(scales, m.in_features)
        assert torch.isin(unit, m.lookup_table().flatten()).all(), name  # every weight: table entry x its scale
        assert not torch.equal(m.hard_weight(torch.float32), hard), name  # and the rounding moved


def test_weighted_kmeans_is_lloyds_with_counted_points():
    gen = torch.Generator().manual_seed(0)
    x, wt = torch.randn(3, 500, generator=gen), torch.rand(3, 500, generator=gen)
    start = torch.randn(3, 8, generator=gen)
    got = dkm.weighted_kmeans_1d(x, wt, start, 100)
    c = start.sort(1).values  # reference: argmin over every centroid, weighted means
    for _ in range(100):
        a = (x.unsqueeze(-1) - c.unsqueeze(1)).abs().argmin(-1)
        num = torch.zeros_like(c).scatter_add_(1, a, x * wt)
        den = torch.zeros_like(c).scatter_add_(1, a, wt)
        c = torch.where(den > 0, num / den.clamp_min(1e-30), c).sort(1).values
    assert torch.allclose(got, c, atol=1e-6)
    assert not torch.allclose(got, dkm.weighted_kmeans_1d(x, torch.ones_like(wt), start, 100), atol=1e-3)


def test_calibration_refit_fits_the_tables_to_the_output_error():
    """`calibration_refit=True`: the tables move to where the weights that matter to the output are, and the
    calibrated layer's output error under the calibration inputs drops below the unrefit one's."""
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (4, 32), generator=gen)
    errors, tables = {}, {}
    for refit in (False, True):
        torch.manual_seed(0)
        config = DKMConfig(bits=3, scale_block_size=16, lut_dtype="float16", calibration_refit=refit)
        model = quantize_model(tiny_llama(), config)
        q = model.model.layers[0].self_attn.q_proj
        inputs = []
        hook = q.register_forward_pre_hook(lambda _m, args, seen=inputs: seen.append(args[0].detach()))
        with torch.no_grad():
            model(batch)
        hook.remove()
        x, w = inputs[0].reshape(-1, q.in_features), q.weight.detach().clone()
        calibrate(model, [batch])
        errors[refit] = (x @ (q.hard_weight(torch.float32) - w).t()).norm()
        tables[refit] = q.centroids.clone()
    assert not torch.equal(tables[False], tables[True])
    assert errors[True] < errors[False], errors
    with pytest.raises(ValueError, match="calibration_refit must be True or False"):
        DKMConfig(calibration_refit="yes")


def _calibrated(max_bytes: int) -> tuple[dict[str, torch.Tensor], int]:
    """(latent weights after `calibrate` holding at most `max_bytes` of moments, forward passes it made)."""
    torch.manual_seed(0)
    model = quantize_model(tiny_llama(), DKMConfig(bits=3, granularity="per_grouped_channel", group_size=1))
    passes = []
    model.register_forward_pre_hook(lambda *_: passes.append(1))
    batches = (torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2))
    assert calibrate(model, batches, max_moment_bytes=max_bytes) == 14  # a generator is read once, kept for all
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, DKMLinear)}, len(passes)


def test_moments_are_held_a_chunk_of_layers_at_a_time_in_model_order():
    whole, passes = _calibrated(MOMENT_BYTES)
    assert passes == 2  # every layer's moments fit: one pass over the two batches
    narrow = 4 * 64**2  # the moments of one 64-input layer; the 128-input down_proj alone exceeds them
    sequential, passes = _calibrated(narrow)
    assert passes == 2 * 14  # a chunk, so a pass over the batches, per layer
    names = list(whole)
    assert torch.equal(whole[names[0]], sequential[names[0]])  # the first layer sees the same inputs either way
    assert not all(torch.equal(whole[k], sequential[k]) for k in names[1:])  # the later ones: earlier ones rounded
    model = quantize_model(tiny_llama(), DKMConfig(bits=3))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, DKMLinear)}
    cut = chunks(layers, 3 * narrow)
    assert [n for c in cut for n in c] == list(layers)  # every layer once, in model order
    assert [len(c) for c in cut] == [3, 3, 1, 3, 3, 1]  # q k v | o gate up | down (alone, over the budget) | ...


def test_each_batch_after_the_first_stops_after_the_chunks_last_layer():
    """A chunk's moments need the model only up to its last layer: every batch after the first stops there, with
    the moments of whole passes bit for bit (the layers after it, lm_head included, do not run)."""
    torch.manual_seed(0)
    model = quantize_model(tiny_llama(), DKMConfig(bits=3))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, DKMLinear)}
    first = chunks(layers, 3 * 4 * 64**2)[0]  # q, k, v of the first decoder layer
    batches = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    heads = []
    model.lm_head.register_forward_pre_hook(lambda *_: heads.append(1))
    early = _inputs(model, first, batches)
    assert len(heads) == 1  # the first batch ran to the end, the other two stopped after v_proj
    whole = _inputs(model, first, batches, whole=True)
    assert len(heads) == 1 + 3
    assert early.keys() == whole.keys() == first.keys()
    assert all(torch.equal(early[n], whole[n]) for n in first)


class _Reused(torch.nn.Module):
    """`a` runs before and after `b`, which runs only on batches of more than one row (some inputs never reach it)."""

    def __init__(self):
        super().__init__()
        settings = DKMSettings.build(16, bits=3, offload=False)
        self.a, self.b = (DKMLinear(16, 16, False, settings) for _ in range(2))
        self.tail = []

    def forward(self, x):
        x = torch.tanh(self.a(x))
        if x.shape[0] > 1:
            x = self.b(x)
        x = self.a(x)
        self.tail.append(1)
        return x


def test_a_layer_run_twice_or_not_reached_by_the_first_batch_keeps_all_its_inputs():
    model = _Reused()
    for layer in (model.a, model.b):
        layer.init_centroids()
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(rows, 16, generator=gen) for rows in (1, 3, 2)]
    chunk = {"a": model.a, "b": model.b}
    early = _inputs(model, chunk, batches)
    assert len(model.tail) == 1  # batches 2 and 3 stop at a's second call (b ran between)
    whole = _inputs(model, chunk, batches, whole=True)
    assert all(torch.equal(early[n], whole[n]) for n in chunk)  # a's second call and b's inputs are counted


class _Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.rows = torch.randint(0, 256, (8, 24), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _trained(tmp_path, samples: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = quantize_model(tiny_llama(), DKMConfig(bits=3, granularity="per_grouped_channel", group_size=1,
                                                   calibration_samples=samples))  # fmt: skip
    args = TrainingArguments(output_dir=str(tmp_path / str(samples)), max_steps=2, per_device_train_batch_size=2,
                             learning_rate=5e-3, use_cpu=True, report_to=[], save_strategy="no", seed=0)  # fmt: skip
    Trainer(model=model, args=args, train_dataset=_Rows(), callbacks=[DKMTrainingStateCallback()]).train()
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, DKMLinear)}


def test_a_trainer_run_ends_with_the_calibrated_rounding(tmp_path):
    plain, calibrated = _trained(tmp_path, 0), _trained(tmp_path, 4)
    assert plain.keys() == calibrated.keys()
    assert all(not torch.equal(plain[k], calibrated[k]) for k in plain)


def test_bad_uses_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"calibration_samples must be an integer >= 0 \(try 128\)"):
        DKMConfig(calibration_samples=-1)
    with pytest.raises(ValueError, match="calibration_samples needs scalar tables: use cluster_dim=1"):
        DKMConfig(calibration_samples=8, cluster_dim=2)
    model = quantize_model(tiny_llama(), DKMConfig(bits=3))
    with pytest.raises(ValueError, match="calibrate got no batches"):
        calibrate(model, [])
    with pytest.raises(ValueError, match=r"max_moment_bytes must be > 0 \(try 1073741824\)"):
        calibrate(model, [torch.zeros(1, 4, dtype=torch.long)], max_moment_bytes=0)
    vectors = quantize_model(tiny_llama(), DKMConfig(bits=3, cluster_dim=2))
    with pytest.raises(ValueError, match="cluster_dim=2: use cluster_dim=1 or calibration_samples=0"):
        calibrate(vectors, [torch.zeros(1, 4, dtype=torch.long)])
    tiny_llama().save_pretrained(tmp_path / "base")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=DKMConfig(bits=3))
    assert calibrate(loaded, [torch.zeros(1, 4, dtype=torch.long)]) == 14
