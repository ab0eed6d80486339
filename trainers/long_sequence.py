"""Long sequences inside `LLMKitTrainer`: what `LLMKitTrainingArguments(tiled_loss=..., tiled_mlp=...,
offload_activation_checkpoints=...)` switches on, with or without sequence parallelism (ALST's techniques).

- `tiled_loss`: the model's forward returns the summed next-token loss computed in chunks of `tiled_loss_chunk_size`
  positions (`hf_llmkit.parallel.sequence.TiledLoss`); this module divides it the way the Trainer's own loss is
  divided (by `num_items_in_batch` when the Trainer passes one to a model that accepts loss kwargs, else by this
  batch's target count), so the loss and gradients equal untiled training. Used for training and for evaluation with
  `prediction_loss_only`; evaluation that returns logits computes them untiled.
- `tiled_mlp`: every decoder layer's MLP runs in chunks of `tiled_mlp_chunk_size` positions under checkpointing
  (`TiledMLP`), in training and evaluation.
- `offload_activation_checkpoints`: nothing here; `LLMKitTrainingArguments` asks transformers' own per-checkpoint
  offload for it (`activation_checkpointing_kwargs={"offload": True}`), which moves each checkpointed layer's input.

When several ranks train, every rank uses the same number of chunks per step (the longest local sequence's), since
DeepSpeed ZeRO-3 gathers parameters at each chunk's call.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Trainer

from hf_llmkit.parallel.sequence.data import IGNORE_INDEX
from hf_llmkit.parallel.sequence.tiled_loss import TARGETS_KWARG, TiledLoss, chunk_count
from hf_llmkit.parallel.sequence.tiled_mlp import TiledMLP
from hf_llmkit.trainers.token_loss import per_target_token


class TrainerLongSequence:
    """The long-sequence state of one trainer; `LLMKitTrainer` (and its sequence-parallel loss) dispatch here."""

    def __init__(self, trainer: Any) -> None:
        args = trainer.args
        self.tiled_loss = TiledLoss(trainer.model, chunk_size=args.tiled_loss_chunk_size) if args.tiled_loss else None
        self.tiled_mlp = TiledMLP(trainer.model, chunk_size=args.tiled_mlp_chunk_size) if args.tiled_mlp else None
        self._loss_only = args.prediction_loss_only
        self._device = args.device

    @classmethod
    def for_trainer(cls, trainer: Any) -> TrainerLongSequence | None:
        """Set up the switched-on techniques, or return None when none is on."""
        args = trainer.args
        switches = ("tiled_loss", "tiled_mlp")
        if not any(getattr(args, name, False) for name in switches):
            return None
        if getattr(args, "tiled_loss", False) and (trainer.compute_loss_func is not None or trainer.label_smoother):
            raise ValueError(
                "tiled_loss computes the causal-LM cross-entropy itself; drop compute_loss_func / "
                "label_smoothing_factor or turn tiled_loss off"
            )
        return cls(trainer)

    def tiles_loss(self, model: torch.nn.Module) -> bool:
        return self.tiled_loss is not None and (model.training or self._loss_only)

    @contextlib.contextmanager
    def forward(self, model: torch.nn.Module, length: int):
        """Around one forward (+ its loss): fix this step's chunk counts."""
        self._plan(length)
        yield

    def _plan(self, length: int) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank makes the same number of calls
            longest = torch.tensor([length], dtype=torch.long, device=self._device)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX)
            length = int(longest.item())
            if self.tiled_loss is not None:
                self.tiled_loss.chunks = chunk_count(length, self.tiled_loss.chunk_size)
            if self.tiled_mlp is not None:
                self.tiled_mlp.chunks = chunk_count(length, self.tiled_mlp.chunk_size)

    def loss_kwargs(self, shift_labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {TARGETS_KWARG: shift_labels}

    def compute_loss(self, trainer: Any, model, inputs: dict, return_outputs: bool, num_items_in_batch=None):
        """`Trainer.compute_loss` with the long-sequence techniques (no sequence parallelism)."""
        if not self.tiles_loss(model) or inputs.get("labels") is None:
            with self.forward(model, inputs["input_ids"].shape[1]):
                return Trainer.compute_loss(trainer, model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        shift_labels = inputs.pop("shift_labels", None)
        if shift_labels is None:
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # [B, S], target of position i
        with self.forward(model, shift_labels.shape[1]):
            outputs = model(**inputs, **self.loss_kwargs(shift_labels))
        targets = (shift_labels != IGNORE_INDEX).sum()
        loss = per_target_token(trainer, outputs["loss"], targets=targets, num_items_in_batch=num_items_in_batch)
        outputs["loss"] = loss
        return (loss, outputs) if return_outputs else loss
