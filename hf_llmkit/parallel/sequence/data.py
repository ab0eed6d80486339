"""Batch sharding along the sequence for sequence-parallel ranks.

Every rank of an SP group gets the same collated batch and keeps its own block of `S / P` consecutive tokens.
The next-token targets are computed on the FULL sequence before the split (`shift_labels`), so the target of a
shard's last token (the first token of the next shard) is not lost; `position_ids` are the global positions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def _pad_value(key: str, pad_token_id: int) -> int:
    if key in ("labels", "shift_labels"):
        return IGNORE_INDEX
    if key == "attention_mask":
        return 0
    return pad_token_id


def shard_sequence_batch(
    batch: Mapping[str, Any], *, sp_rank: int, sp_size: int, pad_token_id: int = 0
) -> dict[str, Any]:
    """This SP rank's shard of a collated causal-LM batch.

    `batch` holds `input_ids` `[B, S]` and optionally `labels`, `attention_mask`, `position_ids` and other
    `[B, S]` tensors; other values pass through. Returns the same keys sharded to `[B, S'/P]` (S' = S padded up to
    a multiple of `sp_size`: ids with `pad_token_id`, labels with -100, mask with 0), plus `position_ids` (global)
    and, when labels are given, `shift_labels` (the next-token targets of the shard's positions, -100 at the end).
    Right padding needs no mask entry: causal attention never lets a real token see a later pad.
    """
    if sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} must be in [0, sp_size={sp_size})")
    input_ids = batch["input_ids"]
    bsz, seq = input_ids.shape
    if seq < sp_size:
        raise ValueError(
            f"sequence length {seq} is shorter than sequence_parallel_size={sp_size}; every rank needs at least one "
            "token: use longer sequences (block_size) or a smaller sequence_parallel_size"
        )
    out = dict(batch)
    if "labels" in batch and batch["labels"] is not None and "shift_labels" not in batch:
        labels = batch["labels"]
        out["shift_labels"] = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # [B, S], target of position i
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(bsz, -1)
    padded = -(-seq // sp_size) * sp_size
    local = padded // sp_size
    start = sp_rank * local
    for key, value in out.items():
        if not (torch.is_tensor(value) and value.dim() == 2 and value.shape == (bsz, seq)):
            continue
        if padded != seq:
            if key == "position_ids":  # keep counting, so padded positions stay distinct
                extra = value[:, -1:] + torch.arange(1, padded - seq + 1, device=value.device)
                value = torch.cat([value, extra], dim=1)
            else:
                value = F.pad(value, (0, padded - seq), value=_pad_value(key, pad_token_id))
        out[key] = value[:, start : start + local].contiguous()
    return out


class SequenceParallelCollator:
    """Wraps a data collator: collate the full batch, then keep this SP rank's sequence shard.

    Example:
        ```python
        collator = SequenceParallelCollator(default_data_collator, sp_rank=groups.sp_rank, sp_size=2)
        ```
    """

    def __init__(self, collator: Callable, *, sp_rank: int, sp_size: int, pad_token_id: int = 0):
        self.collator, self.sp_rank, self.sp_size, self.pad_token_id = collator, sp_rank, sp_size, pad_token_id

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        batch = self.collator(features)
        return shard_sequence_batch(batch, sp_rank=self.sp_rank, sp_size=self.sp_size, pad_token_id=self.pad_token_id)
