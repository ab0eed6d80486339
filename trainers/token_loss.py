"""How a loss summed over target tokens becomes the number the Trainer steps on, as its own causal-LM loss does.

transformers divides a model's summed loss by `num_items_in_batch` (the target tokens of every micro-batch of the
optimizer step, over all ranks when `average_tokens_across_devices`) when it passes one to a model that accepts loss
kwargs, and multiplies by the ranks that average it; otherwise the loss is this batch's mean and the Trainer divides
it by the gradient accumulation steps. A loss computed outside the model (the tiled loss, distillation) divides the
same way, so gradient accumulation and several ranks give the same step as one large batch.

    loss = per_target_token(trainer, summed, targets=(shift_labels != -100).sum(), num_items_in_batch=n)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["per_target_token"]


def per_target_token(trainer: Any, total: torch.Tensor, *, targets: torch.Tensor, num_items_in_batch=None):
    """`total` (summed over this batch's `targets` target tokens) divided as `Trainer.compute_loss` divides."""
    if trainer.model_accepts_loss_kwargs and num_items_in_batch is not None:  # as the model's own loss would
        loss = total / torch.as_tensor(num_items_in_batch, device=total.device)
        if trainer.args.average_tokens_across_devices:
            loss = loss * (trainer.accelerator.num_processes // trainer.get_tp_size())  # as Trainer.compute_loss
        return loss
    return total / targets.clamp(min=1).to(total.device)
