"""`DKMConfig(recipe="calibrated")`: quantization-aware training from the best post-training state, one setting.

The config fills in block scales, 16-bit tables, the sensitivity-weighted refit and 128 calibration samples where the
user left the defaults; `DKMTrainingStateCallback` calibrates once, before the first step, never at the end; training
moves the latent weights only (the calibrated tables and block scales stay), and the saved model is the trained
latent weights' nearest-entry rounding onto them."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_llmkit import DKMConfig
from hf_llmkit.quantization import DKMLinear, DKMTrainingStateCallback, quantize_model, training_state
from hf_llmkit.testing import tiny_llama


def test_the_recipe_fills_the_defaults_and_round_trips():
    config = DKMConfig(bits=4, recipe="calibrated")
    assert (config.scale_block_size, config.lut_dtype, config.calibration_refit) == (64, "float16", True)
    assert (config.calibration_samples, config.dkm_iters) == (128, 0)
    assert DKMConfig(**config.to_dict()) == config
    mine = DKMConfig(recipe="calibrated", scale_block_size=32, calibration_samples=16)
    assert (mine.scale_block_size, mine.calibration_samples) == (32, 16)  # what the user set is kept
    assert (config.latent_lr_scale, DKMConfig(bits=3, recipe="calibrated").latent_lr_scale) == (0.1, 1.0)
    assert DKMConfig(bits=4, recipe="calibrated", latent_lr_scale=0.5).latent_lr_scale == 0.5
    assert DKMConfig(bits=4).latent_lr_scale == 1.0  # the dkm recipe trains them at the full rate
    with pytest.raises(ValueError, match="latent_lr_scale must be a positive number"):
        DKMConfig(latent_lr_scale=0)
    with pytest.raises(ValueError, match="recipe must be one of"):
        DKMConfig(recipe="best")
    with pytest.raises(ValueError, match="keeps its calibrated tables: set dkm_iters=0"):
        DKMConfig(recipe="calibrated", dkm_iters=2)


class _Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.rows = torch.randint(0, 256, (8, 24), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def test_a_run_calibrates_first_then_trains_the_latent_weights_only(tmp_path, monkeypatch):
    calls = []
    real = training_state.calibrate

    def counting(model, batches):
        tables = {n: m.centroids.clone() for n, m in model.named_modules() if isinstance(m, DKMLinear)}
        done = real(model, batches)
        calls.append({n: m.centroids.clone() for n, m in model.named_modules() if isinstance(m, DKMLinear)})
        assert any(not torch.equal(tables[n], calls[-1][n]) for n in tables)  # the refit moved the tables
        return done

    monkeypatch.setattr(training_state, "calibrate", counting)
    torch.manual_seed(0)
    model = quantize_model(tiny_llama(), DKMConfig(bits=3, recipe="calibrated", calibration_samples=8))
    scales = {n: m.scales.clone() for n, m in model.named_modules() if isinstance(m, DKMLinear)}
    args = TrainingArguments(str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                             use_cpu=True, report_to=[], save_strategy="no")  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=_Rows(), callbacks=[DKMTrainingStateCallback()])
    calibrated = {}
    trainer.add_callback(_Snapshot(calibrated))
    trainer.train()
    assert len(calls) == 1  # before the first step, none at the end
    for name, layer in model.named_modules():
        if isinstance(layer, DKMLinear):
            assert torch.equal(layer.centroids, calls[0][name])  # training kept the calibrated tables
            assert torch.equal(layer.scales, scales[name])  # and the block scales
            assert not torch.equal(layer.weight, calibrated[name])  # it moved the latent weights


class _Snapshot(TrainerCallback):
    """The latent weights as the first step sees them (after the start's calibration)."""

    def __init__(self, out: dict):
        self.out = out

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if not self.out:
            self.out.update(
                {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, DKMLinear)}
            )


def test_the_training_forward_is_the_saved_models_forward_with_straight_through_gradients():
    """With the recipe, a training forward computes what evaluation (and the saved, packed model) computes, bit for
    bit, and the loss's gradient reaches every latent weight as the gradient of its hard-assigned value; the plain
    recipe's soft assignment differs from its hard one (what training from a calibrated start used to optimise)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 16))
    outputs = {}
    for recipe in ("calibrated", "dkm"):
        model = quantize_model(tiny_llama(), DKMConfig(bits=3, recipe=recipe, scale_block_size=16))
        training_state.keep_training_state(model, False)
        with torch.no_grad():
            evaluated = model.eval()(ids).logits
        trained = model.train()(ids).logits
        outputs[recipe] = torch.equal(trained, evaluated)
        if recipe == "calibrated":
            trained.square().mean().backward()
            dense = tiny_llama()  # the same model with the hard-assigned weights as plain Linear weights
            dense.load_state_dict(model.state_dict(), strict=False)
            layers = {n: m for n, m in model.named_modules() if isinstance(m, DKMLinear)}
            with torch.no_grad():
                for name, layer in layers.items():
                    dense.get_submodule(name).weight.copy_(layer.hard_weight(torch.float32))
            dense.train()(ids).logits.square().mean().backward()
            for name, layer in layers.items():
                torch.testing.assert_close(layer.weight.grad, dense.get_submodule(name).weight.grad)
    assert outputs == {"calibrated": True, "dkm": False}


def _latent_groups(optimizer) -> list[dict]:
    return [g for g in optimizer.param_groups if training_state.LATENT_GROUP in g]


def test_llmkit_trainer_trains_the_latent_weights_at_their_factor_through_the_schedule(tmp_path):
    from hf_llmkit.trainers import LLMKitTrainer

    torch.manual_seed(0)
    model = quantize_model(tiny_llama(), DKMConfig(bits=4, recipe="calibrated", scale_block_size=16))
    latents = {id(m.weight) for m in model.modules() if isinstance(m, DKMLinear)}
    args = TrainingArguments(str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                             warmup_steps=1, use_cpu=True, report_to=[], save_strategy="no")  # fmt: skip
    trainer = LLMKitTrainer(model=model, args=args, train_dataset=_Rows())
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    (group,) = _latent_groups(trainer.optimizer)
    assert {id(p) for p in group["params"]} == latents  # exactly the latent weights, nothing else
    assert group["lr_scale"] == 0.1
    others = [g for g in trainer.optimizer.param_groups if g is not group]
    assert all(id(p) not in latents for g in others for p in g["params"])
    rates = dict(zip(map(id, trainer.optimizer.param_groups), trainer.lr_scheduler.base_lrs))
    assert rates[id(group)] == pytest.approx(1e-4) and all(rates[id(g)] == 1e-3 for g in others)
    assert training_state.scale_latent_lr(trainer.optimizer, model) == 0  # idempotent
    trainer.optimizer = trainer.lr_scheduler = None
    trainer.train()  # the Trainer makes its own optimizer: the factor is there, through warm-up and decay
    (group,) = _latent_groups(trainer.optimizer)
    assert group["initial_lr"] == pytest.approx(1e-4)


def test_a_plain_trainer_says_in_one_line_that_it_trains_the_latents_at_the_full_rate(tmp_path):
    torch.manual_seed(0)
    model = quantize_model(tiny_llama(), DKMConfig(bits=4, latent_lr_scale=0.25))
    args = TrainingArguments(str(tmp_path), max_steps=1, per_device_train_batch_size=4, use_cpu=True, report_to=[],
                             save_strategy="no")  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=_Rows(), callbacks=[DKMTrainingStateCallback()])
    with pytest.warns(UserWarning, match=r"latent_lr_scale=0.25 is not applied by this Trainer.*LLMKitTrainer"):
        trainer.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # a loop of your own
    moved = training_state.scale_latent_lr(optimizer, model)
    assert moved == sum(isinstance(m, DKMLinear) for m in model.modules())
    assert _latent_groups(optimizer)[0]["lr"] == pytest.approx(2.5e-4)


def test_an_optimizer_passed_in_with_its_scheduler_is_left_as_it_is_and_the_run_says_so(tmp_path):
    """Splitting the groups of a user's optimizer after its scheduler was made would leave the new group off the
    schedule: LLMKitTrainer scales only an optimizer it made, and the callback warns."""
    from hf_llmkit.trainers import LLMKitTrainer

    torch.manual_seed(0)
    model = quantize_model(tiny_llama(), DKMConfig(bits=4, latent_lr_scale=0.5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = TrainingArguments(str(tmp_path), max_steps=1, per_device_train_batch_size=4, use_cpu=True, report_to=[],
                             save_strategy="no")  # fmt: skip
    trainer = LLMKitTrainer(model=model, args=args, train_dataset=_Rows(), optimizers=(optimizer, scheduler))
    with pytest.warns(UserWarning, match=r"latent_lr_scale=0.5 is not applied by this Trainer"):
        trainer.train()
    assert len(optimizer.param_groups) == len(scheduler.base_lrs) == 1
