"""Distillation inside `LLMKitTrainer`: `LLMKitTrainer(..., teacher_model=source)` trains on KL(teacher || model).

The loss of a training step is the Kullback-Leibler divergence of the model's next-token distribution from the
teacher's (the uncompressed source a compressed model was made from, in the main jobs' `--distill_from_source`),
on the same batch: sum over the vocabulary of p_teacher * (log p_teacher - log p_model), at exactly the positions the
causal-LM loss would score (a position counts when its next token's label is not -100: padding and an SFT prompt
count in neither), divided as the Trainer divides its own loss (`hf_llmkit.trainers.token_loss`): by the target tokens
of the whole optimizer step, so gradient accumulation and several ranks give one large batch's step. Both
distributions are taken in float32 from the logits the forward produced (under bf16 autocast too). The teacher is a
second model in memory: frozen, in eval mode (no dropout), run under `torch.no_grad()`; it is deterministic, so a
resumed run computes the same targets. Evaluation keeps the model's own loss (the cross-entropy: perplexity).

A model whose forward adds a router auxiliary loss to its LM loss when given labels (transformers' native MoE,
`output_router_logits`) gets it added the same way here (`router_aux_loss_coef` times the forward's `aux_loss`).

    trainer = LLMKitTrainer(model=dkm_model, args=args, train_dataset=train, teacher_model=source)

The benchmark's distillation (`benchmarks/areas/dkm/smollm2.py`) is the same KL, averaged over every position.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hf_llmkit.parallel.sequence.data import IGNORE_INDEX
from hf_llmkit.trainers.token_loss import per_target_token

__all__ = ["TrainerDistillation", "next_token_kl", "scored_positions"]

_TARGET_KEYS = ("labels", "shift_labels")


def scored_positions(inputs: dict[str, Any]) -> torch.Tensor:
    """[B, S] bool: the positions the causal-LM loss scores (the next token's label is not -100; with no labels,
    the next token is a real one by the attention mask, or every position but the last)."""
    if inputs.get("shift_labels") is not None:
        return inputs["shift_labels"] != IGNORE_INDEX
    ids = inputs["input_ids"]
    if inputs.get("labels") is not None:
        nxt = inputs["labels"][:, 1:] != IGNORE_INDEX  # [B, S-1]
    elif inputs.get("attention_mask") is not None and inputs["attention_mask"].dim() == 2:
        nxt = inputs["attention_mask"][:, 1:].bool()
    else:
        nxt = torch.ones(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool, device=ids.device)
    return F.pad(nxt, (0, 1), value=False)  # [B, S]: the last position has no next token


def next_token_kl(logits: torch.Tensor, teacher_logits: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Sum over the `scored` positions ([B, S] bool) of KL(teacher || model) of the next-token distributions, from
    [B, S, V] logits, in float32."""
    if logits.shape != teacher_logits.shape:
        raise ValueError(
            f"the teacher's logits are {tuple(teacher_logits.shape)} and the model's {tuple(logits.shape)}: "
            "distillation needs the same vocabulary and positions"
        )
    student = F.log_softmax(logits[scored].float(), dim=-1)  # [N, V]
    target = F.log_softmax(teacher_logits[scored].float(), dim=-1)
    return F.kl_div(student, target, log_target=True, reduction="sum")


class TrainerDistillation:
    """The teacher of one trainer; `LLMKitTrainer.compute_loss` dispatches training steps here."""

    def __init__(self, trainer: Any, teacher: torch.nn.Module) -> None:
        self.teacher = teacher.eval().requires_grad_(False)
        if getattr(teacher, "hf_device_map", None) is None:  # a teacher placed by a device map stays where it is
            self.teacher.to(trainer.args.device)

    @classmethod
    def for_trainer(cls, trainer: Any, teacher: torch.nn.Module | None) -> TrainerDistillation | None:
        """Set up distillation from `teacher`, or return None without one; refuses what cannot distil."""
        if teacher is None:
            return None
        args = trainer.args
        clashes = {
            "sequence_parallel_size > 1": getattr(args, "sequence_parallel_size", 1) > 1,
            "tiled_loss": getattr(args, "tiled_loss", False),
            "compute_loss_func": trainer.compute_loss_func is not None,
            "label_smoothing_factor": trainer.label_smoother is not None,
        }
        named = [name for name, on in clashes.items() if on]
        if named:
            raise ValueError(
                f"teacher_model: distillation computes its loss from the whole logits of each sequence, which "
                f"{named[0]} replaces or shards; turn {named[0]} off or drop teacher_model"
            )
        return cls(trainer, teacher)

    def compute_loss(self, trainer: Any, model, inputs: dict, return_outputs: bool, num_items_in_batch=None):
        """The distillation loss of one training batch (see the module docstring)."""
        scored = scored_positions(inputs)
        given = {k: v for k, v in inputs.items() if k not in _TARGET_KEYS}
        outputs = model(**given)
        with torch.no_grad():
            teacher_logits = self.teacher(**given).logits
        total = next_token_kl(outputs.logits, teacher_logits, scored)
        loss = per_target_token(trainer, total, targets=scored.sum(), num_items_in_batch=num_items_in_batch)
        aux = getattr(outputs, "aux_loss", None)
        if aux is not None:  # as the model adds it to its LM loss (transformers' MoE, output_router_logits)
            coef = getattr(trainer.accelerator.unwrap_model(model).config, "router_aux_loss_coef", 0.0)
            loss = loss + coef * aux.to(loss.device)
        outputs["loss"] = loss
        return (loss, outputs) if return_outputs else loss
