"""LLMKitTrainer with MoE models: auxiliary losses in the loss, routing logs, DeepSpeed ZeRO-2 / ZeRO-3."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from hf_llmkit import LLMKitTrainingArguments
from hf_llmkit.parallel import load_balancing_loss, moe_blocks, router_z_loss
from hf_llmkit.parallel.moe.upcycle import upcycle_to_moe
from hf_llmkit.testing import tiny_llama
from hf_llmkit.trainers import LLMKitTrainer
from tests.warm import launch

NUM_EXPERTS = 4


def lm_rows(n: int = 16, length: int = 24) -> Dataset:
    ids = torch.randint(3, 500, (n, length), generator=torch.Generator().manual_seed(0))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def upcycled(**kwargs):
    """transformers' Mixtral blocks computing through `experts_implementation="llmkit"` (`MoELayer`s with a
    `capacity_factor`)."""
    return upcycle_to_moe(tiny_llama(), num_experts=NUM_EXPERTS, top_k=2, **kwargs).train()


def make_trainer(model, out, eval_dataset=None, **overrides) -> LLMKitTrainer:
    kwargs = dict(
        max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, report_to=[],
        save_strategy="no", disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    kwargs.update(overrides)
    args = LLMKitTrainingArguments(str(out), **kwargs)
    return LLMKitTrainer(model=model, args=args, train_dataset=lm_rows(), eval_dataset=eval_dataset)


def router_losses(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The balancing loss and z-loss averaged over the layers, from the router logits transformers collects
    (`output_router_logits=True`), by the per-call definitions of `hf_llmkit.parallel.moe.router`."""
    balancing, z = [], []
    for logits in model(**batch, output_router_logits=True).router_logits:  # [T, E] per layer
        probs = torch.softmax(logits.float(), dim=-1)
        load = torch.bincount(torch.topk(probs, 2, dim=-1).indices.reshape(-1), minlength=NUM_EXPERTS)
        balancing.append(load_balancing_loss(probs, load))
        z.append(router_z_loss(logits))
    return torch.stack(balancing).mean(), torch.stack(z).mean()


@pytest.mark.parametrize("blocks", ["native", "moe_layer"])
def test_compute_loss_adds_weighted_aux_losses_in_training_only(tmp_path, blocks):
    """Transformers' own sparse blocks (our experts through its registry) and `MoELayer` blocks alike."""
    model = upcycled() if blocks == "native" else upcycled(capacity_factor=8.0)
    trainer = make_trainer(model, tmp_path, moe_aux_loss_coef=0.5, moe_z_loss_coef=0.25)
    batch = {k: torch.tensor(v[:4]) for k, v in lm_rows()[:4].items()}
    loss = trainer.compute_loss(model, batch)
    task = model(**batch).loss
    balancing, z = router_losses(model, batch)
    torch.testing.assert_close(loss, task + 0.5 * balancing + 0.25 * z)
    # the aux term carries gradient to the routers
    (loss - task.detach()).backward()
    assert all(m.gate.weight.grad.abs().sum() > 0 for m in moe_blocks(model))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(trainer.compute_loss(model, batch), model(**batch).loss)


def test_training_logs_moe_losses_and_expert_load(tmp_path):
    trainer = make_trainer(upcycled(), tmp_path)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        shares = [entry[f"moe_load_e{i}"] for i in range(NUM_EXPERTS)]
        assert sum(shares) == pytest.approx(1.0, abs=1e-3)
        assert entry["moe_load_max_min_ratio"] >= 1.0
        assert entry["moe_aux_loss"] >= 1.0  # top_k=2: a balanced router scores 2, never below ~1
        assert entry["moe_z_loss"] > 0 and entry["moe_dropped_fraction"] == 0.0


def test_bad_coefficients_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="moe_aux_loss_coef must be >= 0"):
        LLMKitTrainingArguments(str(tmp_path), moe_aux_loss_coef=-1.0)


def deepspeed_train(out_dir: str, stages: list[int]) -> dict:
    """One DeepSpeed rank: for each ZeRO stage, train an upcycled tiny model, save it, report."""
    return {stage: _deepspeed_train_once(f"{out_dir}/zero{stage}", stage) for stage in stages}


def _deepspeed_train_once(out_dir: str, stage: int) -> dict:
    ds_config = {
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_allow_untested_optimizer": True,
    }
    model = upcycled()
    trainer = make_trainer(model, out_dir, deepspeed=ds_config, use_cpu=False, max_steps=2)
    from deepspeed.utils import z3_leaf_module

    leaf = all(z3_leaf_module(m) for m in moe_blocks(model))
    trainer.train()
    trainer.save_model(out_dir + "/final")
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"leaf": leaf, "losses": losses, "logged_load": "moe_load_max_min_ratio" in trainer.state.log_history[0]}


@pytest.fixture(scope="module")
def deepspeed_reports(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("moe_deepspeed")
    (reports,) = launch(
        deepspeed_train, str(out), [2, 3], nprocs=1, timeout=300, init_process_group=False,
        env={"ACCELERATE_USE_DEEPSPEED": "true"},
    )  # fmt: skip
    return out, reports


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_stages_train_and_save_native_moe(deepspeed_reports, stage):
    out, reports = deepspeed_reports
    report = reports[stage]
    assert report["leaf"], "MoE blocks must be ZeRO-3 leaf modules"
    assert len(report["losses"]) == 2 and all(torch.isfinite(torch.tensor(report["losses"])))
    assert report["logged_load"]
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out / f"zero{stage}" / "final")
    assert type(saved).__name__ == "MixtralForCausalLM"
    experts = saved.model.layers[0].mlp.experts.down_proj  # upcycled as identical copies; training separates them
    assert experts.shape[0] == NUM_EXPERTS and not torch.allclose(experts[0], experts[1])


def native_mixtral(folder):
    """The upcycled tiny model saved and loaded back as plain transformers Mixtral (native sparse blocks)."""
    from transformers import MixtralForCausalLM

    upcycled().save_pretrained(folder)
    return MixtralForCausalLM.from_pretrained(folder).train()


@pytest.mark.parametrize("kind", ["moe_layer", "native_mixtral"])
def test_resume_restores_trained_experts_and_routers(tmp_path, kind):
    if kind == "moe_layer":
        build = lambda: upcycled(capacity_factor=8.0)  # noqa: E731
    else:
        build = lambda: native_mixtral(tmp_path / "base")  # noqa: E731
    first = make_trainer(build(), tmp_path / "run", max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    trained = {k: v.clone() for k, v in first.model.state_dict().items() if ".mlp." in k}
    resumed_model = build()
    second = make_trainer(resumed_model, tmp_path / "run", max_steps=2)
    second.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))  # at max_steps: loads, no step
    for key, value in trained.items():
        torch.testing.assert_close(resumed_model.state_dict()[key], value, msg=f"{key} was not restored")


def test_aux_loss_follows_the_trainers_gradient_accumulation_scaling(tmp_path):
    from hf_llmkit.trainers.moe_loss import aux_loss_scale

    trainer = make_trainer(upcycled(), tmp_path, gradient_accumulation_steps=4)
    trainer.current_gradient_accumulation_steps = 4
    assert trainer.model_accepts_loss_kwargs  # causal LMs normalise their loss by num_items_in_batch
    # the task loss is already divided by all accumulated tokens: the Trainer will not divide by 4 again
    assert aux_loss_scale(trainer, num_items_in_batch=torch.tensor(100)) == 0.25
    # without num_items_in_batch the Trainer divides the whole loss by 4 itself
    assert aux_loss_scale(trainer, num_items_in_batch=None) == 1.0


def test_load_best_model_at_end_restores_the_best_experts(tmp_path):
    from transformers import AutoModelForCausalLM

    model = upcycled()
    trainer = make_trainer(
        model, tmp_path, max_steps=2, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
        load_best_model_at_end=True, metric_for_best_model="eval_loss", eval_dataset=lm_rows(4),
    )  # fmt: skip
    trainer.train()
    with torch.no_grad():  # whichever step was best, the weights must now come back from its checkpoint
        for layer in moe_blocks(model):
            layer.experts.down_proj.add_(1.0)
    trainer._load_best_model()
    best = AutoModelForCausalLM.from_pretrained(trainer.state.best_model_checkpoint)
    for key, value in best.state_dict().items():
        if ".mlp." in key:
            torch.testing.assert_close(model.state_dict()[key], value, msg=f"{key} is not the best checkpoint's")


def test_the_registry_path_trains_and_exports_a_native_checkpoint(tmp_path):
    """transformers' own blocks computing through `experts_implementation="llmkit"` train with `LLMKitTrainer`, and
    the saved checkpoint loads in plain transformers (its default grouped_mm experts) with the trained logits."""
    from transformers import AutoModelForCausalLM

    model = upcycled()
    before = {k: v.clone() for k, v in model.state_dict().items() if ".mlp." in k}
    trainer = make_trainer(model, tmp_path, max_steps=2)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    after = model.state_dict()
    assert not any(torch.equal(before[k], after[k]) for k in before if "experts" in k)  # the experts trained
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    assert native.config._experts_implementation == "grouped_mm"
    ids = torch.tensor([[5, 9, 2, 7, 3, 8]])
    with torch.no_grad():
        torch.testing.assert_close(native(ids).logits, model.eval()(ids).logits, atol=1e-5, rtol=1e-5)
