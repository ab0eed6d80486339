"""Causal-LM loss over a sequence-parallel group: the token-weighted mean of all shards' next-token losses.

Every SP rank returns the same value, the loss of the whole sequence. The sum over ranks is differentiable
(`all_reduce` forward, `all_reduce` of the gradients backward), so each rank's backward carries the gradient of
the group loss times the group size; data-parallel gradient averaging over the world (DDP, DeepSpeed) divides it
back out, leaving exactly the gradient of single-rank training on the same global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_llmkit.parallel.sequence.data import IGNORE_INDEX


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable sum of `x` over `group` (every rank gets the sum)."""
    return _AllReduceSum.apply(x, group)


def sequence_parallel_loss(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Token-weighted mean cross-entropy of the SP group's shards.

    Args:
        logits: `[B, S/P, V]` this rank's logits.
        shift_labels: `[B, S/P]` targets already shifted on the full sequence (-100 = ignored).
        group: the SP group.
        num_items_in_batch: the valid-token count to divide by (e.g. over gradient accumulation); by default the
            count of valid targets over the group. A group with no valid target gets loss 0, not NaN.
    """
    local_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return sequence_parallel_mean(local_sum, shift_labels, group=group, num_items_in_batch=num_items_in_batch)


def sequence_parallel_mean(
    local_sum: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """The group's token-weighted mean from this rank's summed token losses (e.g. from the tiled loss).

    Args and the denominator as in `sequence_parallel_loss`; `local_sum` is the sum of this rank's token losses.
    """
    total = all_reduce_sum(local_sum, group)
    if num_items_in_batch is None:
        count = (shift_labels != IGNORE_INDEX).sum().to(device=local_sum.device, dtype=torch.float32)
        dist.all_reduce(count, group=group)
        num_items_in_batch = count.clamp(min=1)
    elif torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device).clamp(min=1)
    else:
        num_items_in_batch = max(num_items_in_batch, 1)
    return total / num_items_in_batch
