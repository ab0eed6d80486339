"""Mixture-of-experts support for `LLMKitTrainer`: auxiliary losses, routing logs, ZeRO-3 leaf modules.

After each training forward, every MoE block -- an `MoELayer`, or a transformers Mixtral / Qwen2-MoE sparse block
(whose router `watch_native_routers` hooks) -- has recorded what it routed (`hf_llmkit.parallel.moe.routing_stats`:
over all its calls, so a tiled MLP's chunks count as one call). `MoELossTracker.add_aux_losses` adds
`moe_aux_loss_coef * mean(balancing) + moe_z_loss_coef * mean(z)` over the blocks to the task loss, weighted the
way the Trainer weights that micro-batch's task loss, and keeps running sums that `logs()` turns into
`moe_aux_loss`, `moe_z_loss`, `moe_dropped_fraction`, the load share of each expert (`moe_load_e{i}`, summed over
layers) and `moe_load_max_min_ratio` (busiest / least busy expert, the least busy counted as at least one token),
all rank-local.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_llmkit.parallel.moe.expert_parallel import expert_shards, shard_expert_state
from hf_llmkit.parallel.moe.routing_stats import clear_routing, moe_blocks, take_routing


def register_zero3_leaf_modules(model: nn.Module) -> bool:
    """Mark MoE blocks (`MoELayer`s, transformers' sparse blocks) as DeepSpeed ZeRO-3 leaf modules (gathered whole:
    a block computes only the experts its tokens chose)."""
    blocks = moe_blocks(model)
    if not blocks:
        return False
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, sorted({type(block) for block in blocks}, key=lambda cls: cls.__name__))
    return True


def has_moe_blocks(model: nn.Module) -> bool:
    """Whether `model` holds `MoELayer`s or transformers' Mixtral / Qwen2-MoE sparse blocks."""
    return bool(moe_blocks(model))


def load_moe_checkpoint(model: nn.Module, folder: str) -> None:
    """Load a `save_pretrained` checkpoint folder into an MoE model (used to resume and to load the best model).

    `save_pretrained` writes MoE experts in the hub layout (one tensor per expert), which only
    `from_pretrained`'s conversion turns back into the fused tensors; `Trainer`'s plain `load_state_dict`
    would leave every expert and router at its initial value (native Mixtral models included). The folder is
    loaded as the model's native class, whose state dict has the same keys as the model with `MoELayer`s.
    Under expert parallelism each rank keeps its own shard of the (full) saved experts.
    """
    dtype = next(model.parameters()).dtype
    native = type(model).from_pretrained(folder, config=model.config, dtype=dtype)
    state = shard_expert_state(native.state_dict(), expert_shards(model))
    model.load_state_dict(state)  # strict: a layout mismatch fails loudly


def aux_loss_scale(trainer, num_items_in_batch) -> float:
    """Weight of one micro-batch's auxiliary loss, mirroring how `Trainer.training_step` scales the task loss.

    When the task loss is already normalised by the tokens of all accumulated micro-batches, the Trainer does
    not divide by the accumulation steps, so the (per-micro-batch mean) auxiliary loss is divided here.
    """
    scaled = trainer.loss_is_scaled_for_ga
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
            trainer.compute_loss_func is not None
        )
    return 1.0 / trainer.current_gradient_accumulation_steps if scaled else 1.0


class MoELossTracker:
    """Adds the MoE auxiliary losses to a loss and accumulates routing statistics between logging steps.

    Args:
        aux_loss_coef: weight of the Switch load-balancing loss (mean over MoE layers).
        z_loss_coef: weight of the router z-loss (mean over MoE layers).
    """

    def __init__(self, *, aux_loss_coef: float, z_loss_coef: float):
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self._reset()

    def _reset(self) -> None:
        self._steps = 0
        self._aux = self._z = self._dropped = 0.0
        self._load: torch.Tensor | None = None

    @staticmethod
    def begin_forward(model: nn.Module) -> None:
        """Before a training forward: forget what the blocks recorded since (recomputations in the last backward)."""
        clear_routing(model)

    def add_aux_losses(self, model: nn.Module, loss: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        """`loss + scale * (aux_coef * balancing + z_coef * z)` from what the blocks routed in the forward (then
        cleared: a block that does not run next step must not count twice)."""
        auxes = [aux for aux in map(take_routing, moe_blocks(model)) if aux is not None]
        if not auxes:
            return loss
        balancing = torch.stack([a.load_balancing_loss for a in auxes]).mean()
        z = torch.stack([a.z_loss for a in auxes]).mean()
        self._steps += 1
        self._aux += balancing.item()
        self._z += z.item()
        self._dropped += sum(float(a.dropped_fraction) for a in auxes) / len(auxes)
        if len({a.expert_load.numel() for a in auxes}) == 1:
            load = torch.stack([a.expert_load for a in auxes]).sum(0).double().cpu()
            self._load = load if self._load is None else self._load + load
        extra = self.aux_loss_coef * balancing + self.z_loss_coef * z
        return loss + scale * extra.to(loss.dtype)

    def logs(self) -> dict[str, float]:
        """Averages since the previous call (empty when no MoE forward ran); resets the sums."""
        if not self._steps:
            return {}
        n = self._steps
        out = {"moe_aux_loss": self._aux / n, "moe_z_loss": self._z / n, "moe_dropped_fraction": self._dropped / n}
        if self._load is not None:
            share = self._load / self._load.sum().clamp(min=1)
            out.update({f"moe_load_e{i}": round(float(s), 4) for i, s in enumerate(share)})
            out["moe_load_max_min_ratio"] = float(self._load.max() / self._load.min().clamp(min=1))
        self._reset()
        return out
