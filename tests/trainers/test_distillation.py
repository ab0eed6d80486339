"""`LLMKitTrainer(teacher_model=...)` (hf_llmkit.trainers.distillation), below the main jobs' flag: a model that is
its teacher has loss 0; a native MoE model keeps its router loss; what shards or replaces the logits is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig

from hf_llmkit.testing import tiny_llama, tiny_training_args
from hf_llmkit.trainers import LLMKitTrainer


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def test_a_model_that_is_its_teacher_has_loss_zero_and_a_native_moe_keeps_its_router_loss(tmp_path):
    model = tiny_llama()
    trainer = LLMKitTrainer(model=model, args=tiny_training_args(tmp_path), teacher_model=copy.deepcopy(model))
    trainer.current_gradient_accumulation_steps = 1  # set by train()
    assert trainer.compute_loss(model.train(), _batch(512)).item() == 0

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True, router_aux_loss_coef=0.5)  # fmt: skip
    moe = AutoModelForCausalLM.from_config(config)
    args = tiny_training_args(tmp_path, moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0)  # the model's own loss only
    trainer = LLMKitTrainer(model=moe, args=args, teacher_model=copy.deepcopy(moe))
    trainer.current_gradient_accumulation_steps = 1  # set by train()
    batch = _batch(64)
    aux = moe.train()(**batch).aux_loss
    assert aux > 0
    torch.testing.assert_close(trainer.compute_loss(moe, batch), 0.5 * aux)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [({"tiled_loss": True}, "tiled_loss"), ({"label_smoothing_factor": 0.1}, "label_smoothing_factor")],
    ids=["tiled-loss", "smoothing"],
)
def test_what_replaces_the_logits_is_refused(tmp_path, overrides, named):
    model = tiny_llama()
    with pytest.raises(ValueError, match=rf"^teacher_model: .* {named} replaces or shards; turn {named} off"):
        LLMKitTrainer(model=model, args=tiny_training_args(tmp_path, **overrides), teacher_model=tiny_llama())
