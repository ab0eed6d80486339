"""Expert parallelism applied to a whole model: shard, broadcast, gather for saving, slice for loading, grad norm.

Plain functions over a model whose MLPs are `MoELayer`s (or transformers' Mixtral / Qwen2-MoE sparse blocks, which
`apply_expert_parallel` swaps for `MoELayer`s first). Under a layout from `new_expert_parallel_groups`:

- rank `i` of each expert-parallel (EP) group holds expert shard `i` of every layer (`E / P` experts);
- dense parameters are replicated on every rank, expert shards on the ranks of their replica group;
- the full (native, EP-size independent) layout is what is saved: `gather_expert_state` rebuilds it on the first
  EP group and `shard_expert_state` cuts this rank's shard back out of it.

Example (training loop of your own; `LLMKitTrainer(args=LLMKitTrainingArguments(expert_parallel_size=P))` does
all of it for you):
    ```python
    groups = new_expert_parallel_groups(ep_size=2)
    apply_expert_parallel(model, groups=groups)
    broadcast_parameters_(model, groups=groups)
    ```
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hf_llmkit.parallel.groups import ExpertParallelGroups
from hf_llmkit.parallel.moe.layer import MoELayer, moe_layers
from hf_llmkit.parallel.moe.upcycle import is_native_moe_block, use_moe_layers

EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")  # [E, ., .] tensors split along dim 0


def apply_expert_parallel(
    model: nn.Module, *, groups: ExpertParallelGroups, shard_weights: bool = True
) -> list[MoELayer]:
    """Make every MoE layer of `model` expert-parallel over `groups.ep_group`, in place; returns the layers.

    Native Mixtral / Qwen2-MoE sparse blocks are first replaced by equivalent `MoELayer`s (same state-dict keys).
    With `shard_weights=False` every rank keeps all expert weights and computes only its own experts (see
    `MoELayer.enable_expert_parallel_`). Raises ValueError when `model` has no MoE layer or the expert count
    is not a multiple of `groups.ep_size`.
    """
    if not moe_layers(model):
        if not any(is_native_moe_block(m) for m in model.modules()):
            raise ValueError(
                f"expert parallelism needs a mixture-of-experts model; {type(model).__name__} has no MoE layer "
                "(upcycle a dense model first: --upcycle_moe true / upcycle_to_moe)"
            )
        use_moe_layers(model)
    layers = moe_layers(model)
    for layer in layers:
        layer.enable_expert_parallel_(groups.ep_group, shard_weights=shard_weights)
    return layers


@dataclass(frozen=True)
class ExpertShard:
    """One sharded expert weight: this rank holds experts `[start, start + count)` of `total`."""

    param: nn.Parameter
    start: int
    count: int
    total: int


def expert_shards(model: nn.Module) -> dict[str, ExpertShard]:
    """The sharded expert weights of `model` by state-dict name (empty when no layer shards its weights)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, MoELayer) and module.ep_size > 1 and not module.replicated_experts:
            prefix = f"{name}." if name else ""
            start, count = module.ep_rank * module.num_local_experts, module.num_local_experts
            for weight in EXPERT_WEIGHTS:
                param = module.get_parameter(weight)
                out[prefix + weight] = ExpertShard(param, start, count, module.num_experts)
    return out


@torch.no_grad()
def broadcast_parameters_(model: nn.Module, *, groups: ExpertParallelGroups) -> None:
    """Make replicas identical, as DDP's start does: dense tensors from global rank 0, expert shards from the
    first rank holding them (collective over the world)."""
    experts = {id(shard.param) for shard in expert_shards(model).values()}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in experts:
            if groups.num_replicas > 1:  # global rank `ep_rank` is the first replica of this shard
                dist.broadcast(tensor.data, src=groups.ep_rank, group=groups.replica_group)
        else:
            dist.broadcast(tensor.data, src=0)


def gather_expert_state(
    local: dict[str, torch.Tensor],
    *,
    groups: ExpertParallelGroups,
    totals: dict[str, int],
    first_replica_only: bool = True,
) -> dict[str, torch.Tensor] | None:
    """Full tensors `[E, ...]` from each rank's shards `[E/P, ...]` of the entries of `local` named in `totals`
    (name -> E); other entries are returned unchanged.

    Collective over each EP group. With `first_replica_only` only the first EP group (`replica_rank == 0`, which
    holds global rank 0) gathers; the other replicas hold the same shards and return None at once.
    """
    if first_replica_only and groups.replica_rank != 0:
        return None
    out = dict(local)
    for name, total in totals.items():
        shard = local[name].contiguous()
        if shard.shape[0] == total:  # already full
            continue
        pieces = [torch.empty_like(shard) for _ in range(groups.ep_size)]
        dist.all_gather(pieces, shard, group=groups.ep_group)
        out[name] = torch.cat(pieces)
    return out


def shard_expert_state(full: dict[str, torch.Tensor], shards: dict[str, ExpertShard]) -> dict[str, torch.Tensor]:
    """This rank's slice of every full `[E, ...]` entry of `full` named in `shards` (shard-sized ones are kept)."""
    out = dict(full)
    for name, shard in shards.items():
        if name not in full:
            continue
        tensor = full[name]
        if tensor.shape[0] == shard.total:
            out[name] = tensor[shard.start : shard.start + shard.count].clone()
        elif tensor.shape[0] != shard.count:
            raise ValueError(
                f"{name} holds {tensor.shape[0]} experts; expected all {shard.total} or this rank's {shard.count}"
            )
    return out


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    *,
    expert: set[int],
    groups: ExpertParallelGroups,
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over the whole model when experts are sharded: the norm of the dense
    gradients (equal on every rank) and of all expert shards (summed over the EP group), so every rank clips by
    the norm single-rank training would see. `expert` holds the `id()` of the sharded expert parameters."""
    params = [p for p in parameters if p.grad is not None]
    dense = [p.grad for p in params if id(p) not in expert]
    shards = [p.grad for p in params if id(p) in expert]
    device = params[0].grad.device if params else torch.device("cpu")
    zero = torch.zeros((), device=device)
    dense_sq = torch.nn.utils.get_total_norm(dense).to(device).square() if dense else zero
    expert_sq = torch.nn.utils.get_total_norm(shards).to(device).square() if shards else zero.clone()
    dist.all_reduce(expert_sq, group=groups.ep_group)
    total = (dense_sq + expert_sq).sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
