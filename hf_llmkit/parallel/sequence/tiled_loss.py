"""Tiled loss (ALST): a causal LM's logits and cross-entropy computed in sequence chunks, never `[S, vocab]` at once.

`tiled_cross_entropy_sum` applies the LM head and the cross-entropy to one chunk of positions at a time, each chunk
under activation checkpointing (non-reentrant), so the forward keeps one chunk's logits alive at a time and saves
only the hidden states; the backward recomputes one chunk's logits, takes their gradient and frees them before the
next. The result is the sum of the per-token losses, equal to the untiled sum up to fp32 summation order.

`TiledLoss` puts that computation inside the model's own forward, through module hooks on the transformers causal
LM: a call `model(**inputs, llmkit_loss_targets=shift_labels)` (through any peft / DDP / DeepSpeed wrapper) returns
`loss` = the SUM of the next-token losses of `shift_labels` (-100 = ignored) and `logits` for the first position
only. Staying inside the forward keeps DDP's unused-parameter search and DeepSpeed's hooks seeing the LM head.
The model's own logits at the first position are compared with our head's once, so a model that post-processes its
logits (soft-capping, scaling) is refused with a clear error instead of training on a different loss.

    tiled = TiledLoss(model, chunk_size=1024)
    out = model(input_ids=ids, llmkit_loss_targets=F.pad(labels[:, 1:], (0, 1), value=-100))
    loss = out.loss / (labels[:, 1:] != -100).sum()
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_llmkit.parallel.sequence.chunks import sequence_chunks
from hf_llmkit.parallel.sequence.data import IGNORE_INDEX

TARGETS_KWARG = "llmkit_loss_targets"


def chunk_count(length: int, chunk_size: int) -> int:
    """Chunks of at most `chunk_size` positions that cover `length` (at least 1)."""
    return max(1, -(-length // chunk_size))


def _chunk_loss_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # 2D whatever the chunk's strides (a view, or an offloaded copy when recomputed): the same kernels both times
    logits = head(hidden.reshape(-1, hidden.shape[-1])).float()  # [B * c, V], only this chunk's
    return F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def tiled_cross_entropy_sum(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, *, chunk_size: int, chunks: int | None = None
) -> torch.Tensor:
    """Sum over positions of `cross_entropy(head(hidden), targets)`, computed `chunk_size` positions at a time.

    Args:
        hidden: `[B, S, H]` final hidden states (after the model's last norm).
        head: the LM head module (called per chunk, so ZeRO-3 gathers it and adapters on it apply).
        targets: `[B, S]` next-token targets, -100 where there is none.
        chunk_size: positions per chunk.
        chunks: use exactly this many chunks (ranks that gather parameters per call must agree on the count).
    """
    if hidden.shape[:2] != targets.shape:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden states {tuple(hidden.shape[:2])}")
    n = chunks if chunks is not None else chunk_count(hidden.shape[1], chunk_size)
    targets = targets.to(hidden.device)
    total = hidden.new_zeros((), dtype=torch.float32)
    bounds = [hidden.shape[1] * i // n for i in range(n + 1)]  # the same split as sequence_chunks
    for h, start, stop in zip(sequence_chunks(hidden, n), bounds, bounds[1:]):
        t = targets[:, start:stop]
        total = total + checkpoint(_chunk_loss_sum, head, h, t, use_reentrant=False)  # [B, c, V] freed here
    return total


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The outermost transformers model inside `model` that has an LM head and a decoder."""
    from transformers import PreTrainedModel

    for sub in model.modules():
        if isinstance(sub, PreTrainedModel) and sub.get_output_embeddings() is not None:
            return sub
    raise ValueError(
        f"tiled_loss needs a transformers causal LM with an output embedding (lm_head), got {type(model).__name__}; "
        "turn tiled_loss off for this model"
    )


class TiledLoss:
    """Hooks that make a causal LM compute its loss tiled, inside its forward (see the module docstring).

    Args:
        model: the model (or a wrapper around it) to hook.
        chunk_size: positions per chunk.
    """

    def __init__(self, model: nn.Module, *, chunk_size: int) -> None:
        if chunk_size < 1:
            raise ValueError(f"tiled loss chunk_size must be >= 1, got {chunk_size}")
        self.lm = causal_lm_of(model)
        if "logits_to_keep" not in inspect.signature(self.lm.forward).parameters:
            raise ValueError(
                f"{type(self.lm).__name__}.forward takes no logits_to_keep, so its full logits cannot be skipped; "
                "turn tiled_loss off for this model"
            )
        self.decoder = self.lm.get_decoder()
        self.chunk_size, self.chunks = chunk_size, None
        self._targets: torch.Tensor | None = None
        self._hidden: torch.Tensor | None = None
        self._checked = False
        self._handles = [
            self.lm.register_forward_pre_hook(self._before, with_kwargs=True),
            self.decoder.register_forward_hook(self._capture),
            self.lm.register_forward_hook(self._after, with_kwargs=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        targets = kwargs.pop(TARGETS_KWARG, None)
        self._targets, self._hidden = targets, None
        if targets is None:
            return args, kwargs
        if kwargs.get("labels") is not None:
            raise ValueError(f"pass either labels or {TARGETS_KWARG}, not both")
        # The model's own head on position 0 only: checked against ours once; the full logits are never built.
        kwargs["logits_to_keep"] = torch.zeros(1, dtype=torch.long, device=targets.device)
        return args, kwargs

    def _capture(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._targets is not None:
            self._hidden = output[0]  # last_hidden_state [B, S, H]

    def _after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any):
        targets, hidden = self._targets, self._hidden
        self._targets = self._hidden = None
        if targets is None:
            return None
        if hidden is None:
            raise ValueError(f"{type(self.decoder).__name__} did not run inside {type(self.lm).__name__}.forward")
        head = self.lm.get_output_embeddings()
        if not self._checked:
            self._check_head(head, hidden, output["logits"])
        output["loss"] = tiled_cross_entropy_sum(hidden, head, targets, chunk_size=self.chunk_size, chunks=self.chunks)
        return output

    def _check_head(self, head: nn.Module, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        with torch.no_grad():
            ours = head(hidden[:, :1])
        if ours.shape != logits.shape or not torch.allclose(ours.float(), logits.float(), rtol=1e-4, atol=1e-5):
            raise ValueError(
                f"{type(self.lm).__name__} post-processes its logits (soft-capping or scaling), which the tiled loss "
                "does not reproduce; turn tiled_loss off for this model"
            )
        self._checked = True
