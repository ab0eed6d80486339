"""The loss watch of `FaultToleranceCallback`: NaN/Inf and spike detection with one small collective per step."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hf_llmkit.checkpoints.collectives import world_size

__all__ = ["LossWatch"]


class LossWatch:
    """Captures each training forward's loss (a forward hook) and judges every optimizer step.

    Args:
        spike_factor: A step's mean loss above this multiple of the running average is a spike (None: never).
        warmup_steps: Steps of running average collected before spikes are judged.
        ema_decay: Decay of the running average (closer to 1: longer memory).
    """

    def __init__(self, *, spike_factor: float | None, warmup_steps: int, ema_decay: float):
        if spike_factor is not None and spike_factor <= 1.0:
            raise ValueError(f"loss_spike_factor must be > 1 (e.g. 3.0) or None, got {spike_factor}")
        if not 0.0 < ema_decay < 1.0:
            raise ValueError(f"loss_ema_decay must be in (0, 1), e.g. 0.9; got {ema_decay}")
        if warmup_steps < 1:
            raise ValueError(f"loss_spike_warmup_steps must be >= 1, got {warmup_steps}")
        self.spike_factor, self.warmup_steps, self.ema_decay = spike_factor, warmup_steps, ema_decay
        self.ema: float | None = None
        self.good_steps = 0
        self._losses: list[torch.Tensor] = []
        self._hook = None

    def attach(self, model) -> None:
        self._losses = []
        if model is not None and self._hook is None:
            self._hook = model.register_forward_hook(self.capture)

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def capture(self, module, inputs, output) -> None:
        """Forward hook: keep the (detached, on-device) loss of every training forward."""
        if not module.training:
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach())

    def verdict(self, device, *, signal_seen: bool) -> tuple[bool, bool, float | None]:
        """(signal seen on any rank, loss non-finite on any rank, mean loss over ranks) for the step just done."""
        losses, self._losses = self._losses, []
        values = torch.stack([loss.float().reshape(()) for loss in losses]).tolist() if losses else []  # one sync
        nonfinite = sum(not math.isfinite(v) for v in values)
        stats = [float(signal_seen), float(nonfinite), 0.0, 0.0]
        if values and not nonfinite:
            stats[2:] = [sum(values) / len(values), 1.0]
        if world_size() > 1:
            tensor = torch.tensor(stats, device=device)
            dist.all_reduce(tensor)  # one small collective per step: every rank must reach the same decision
            stats = tensor.tolist()
        seen, nonfinite_ranks, loss_sum, finite_ranks = stats
        return seen > 0, nonfinite_ranks > 0, (loss_sum / finite_ranks if finite_ranks else None)

    def is_spike(self, loss: float | None) -> bool:
        """Whether `loss` is a spike; a normal loss updates the running average."""
        if loss is None or self.spike_factor is None:
            return False
        spike = self.good_steps >= self.warmup_steps and loss > self.spike_factor * self.ema
        if not spike:
            self.ema = loss if self.ema is None else self.ema_decay * self.ema + (1 - self.ema_decay) * loss
            self.good_steps += 1
        return spike

    @staticmethod
    def weights_finite(model) -> bool:
        """Every trainable weight is finite (one fp32-accumulated sum per tensor, far cheaper than isfinite)."""
        if model is None:
            return True
        sums = [
            torch.sum(p.detach(), dtype=torch.float32) for p in model.parameters() if p.requires_grad and p.numel()
        ]
        return not sums or bool(torch.isfinite(torch.stack([s.cpu() for s in sums])).all())
