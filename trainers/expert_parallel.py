"""Expert parallelism inside `LLMKitTrainer`: what `LLMKitTrainingArguments(expert_parallel_size=P)` switches on.

- process groups: world = replicas x P; EP groups of P consecutive ranks exchange tokens, and the ranks holding
  the same expert shard form a replica group (`new_expert_parallel_groups`);
- model: every MoE layer computes only this rank's `E / P` experts (`apply_expert_parallel`), tokens travel to
  their experts and back by all-to-all; batches stay data-parallel over the whole world.

How gradients are reduced depends on the engine:

- DDP: each rank holds only its expert shard. DDP would broadcast rank 0's shard to everyone at start and average
  every gradient over the world, so the trainer's DDP kwargs handler is swapped for one that builds DDP without its
  start-up broadcast (`init_sync=False`; the trainer broadcasts dense weights and expert shards itself, each from
  its right source) and registers a DDP communication hook: dense gradients are averaged over the world, expert
  gradients summed over their replica group and divided by the world size, which is exactly the average that
  single-rank-per-expert data parallelism computes. Gradient clipping uses the norm over all experts
  (`clip_grad_norm_`), so every rank clips alike. Checkpoints hold the full model (`save_pretrained` writes a
  native Mixtral / Qwen2-MoE checkpoint) and full optimizer states; loading cuts each rank's shard back out, so a
  checkpoint resumes under any expert-parallel size.
- DeepSpeed ZeRO-2: DeepSpeed reduces separately only the expert parameters of its own `deepspeed.moe` layers.
  Here every rank keeps all expert weights (`shard_weights=False`) and computes only its own experts, so the
  gradients of the others are zero on it; DeepSpeed's usual average over the world is then the correct expert
  gradient, and ZeRO partitions the experts' gradients and optimizer states over all ranks. What is not sharded
  is the 16/32-bit copy of the expert weights. Checkpoints are DeepSpeed's own plus the full model.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

from hf_llmkit.compat.accelerate import replace_ddp_handler, unwrap_optimizer
from hf_llmkit.parallel.dims import ParallelDims
from hf_llmkit.parallel.groups import ExpertParallelGroups, new_expert_parallel_groups
from hf_llmkit.parallel.host_clashes import check_expert_parallel_model
from hf_llmkit.parallel.moe.expert_parallel import (
    apply_expert_parallel,
    broadcast_parameters_,
    clip_grad_norm_,
    expert_shards,
    gather_expert_state,
    shard_expert_state,
)


class TrainerExpertParallel:
    """The expert-parallel state of one trainer; `LLMKitTrainer` dispatches its DDP, clipping and saving here."""

    def __init__(self, trainer: Any, groups: ExpertParallelGroups):
        self.groups = groups
        self.deepspeed = trainer.is_deepspeed_enabled
        apply_expert_parallel(trainer.model, groups=groups, shard_weights=not self.deepspeed)
        self.shards = expert_shards(trainer.model)  # empty under DeepSpeed (weights replicated)
        self.expert_ids = {id(shard.param) for shard in self.shards.values()}
        self.totals = {name: shard.total for name, shard in self.shards.items()}
        self._gathered_optimizer_state: dict[int, dict] | None = None
        if not self.deepspeed:
            broadcast_parameters_(trainer.model, groups=groups)
            replace_ddp_handler(
                trainer.accelerator,
                lambda base: ExpertParallelDDPKwargs(base, expert_ids=self.expert_ids, groups=groups),
            )
            if trainer.optimizer is not None:  # passed in by the user: `create_optimizer` will not run
                self.attach_optimizer(trainer.optimizer)

    @classmethod
    def for_trainer(cls, trainer: Any) -> TrainerExpertParallel | None:
        """Set up expert parallelism when `trainer.args.expert_parallel_size > 1`, else return None."""
        size = getattr(trainer.args, "expert_parallel_size", 1)
        if size <= 1:
            return None
        args, world = trainer.args, trainer.args.world_size
        check_expert_parallel_model(size, trainer.model)  # transformers' own expert parallelism is not ours
        ParallelDims(world=world, sp=getattr(args, "sequence_parallel_size", 1), ep=size)
        if trainer.is_fsdp_enabled:
            raise ValueError("expert_parallel_size > 1 is not supported with FSDP; use DDP or DeepSpeed ZeRO-2")
        if trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
            raise ValueError(
                "expert_parallel_size > 1 is not supported with DeepSpeed ZeRO-3 (it partitions the expert weights "
                "itself); use ZeRO-2 or DDP"
            )
        return cls(trainer, new_expert_parallel_groups(ep_size=size))

    # ---- optimizer states: saved full, loaded as this rank's shard ----
    def attach_optimizer(self, optimizer) -> None:
        """Make `optimizer.state_dict()` hold full expert states (after `gather_optimizer_state`) and
        `load_state_dict` accept full ones (from any expert-parallel size). DDP only."""
        if self.deepspeed or not self.shards:
            return
        inner = unwrap_optimizer(optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        inner.register_state_dict_post_hook(self._full_optimizer_state)
        inner.register_load_state_dict_pre_hook(self._shard_optimizer_state)

    def _expert_indices(self, optimizer) -> dict[int, str]:
        """Positions of the sharded expert parameters in `optimizer`'s state dict, with their state-dict names."""
        names = {id(shard.param): name for name, shard in self.shards.items()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {i: names[id(p)] for i, p in enumerate(params) if id(p) in names}

    def gather_optimizer_state(self, optimizer, *, everywhere: bool = False) -> None:
        """Collective over the first EP group (every EP group with `everywhere`): full expert states for the next
        `optimizer.state_dict()`."""
        inner = unwrap_optimizer(optimizer)
        gathered = {}
        for index, name in self._expert_indices(inner).items():
            param = self.shards[name].param
            state = inner.state.get(param, {})
            shaped = {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == param.shape}
            totals = dict.fromkeys(shaped, self.totals[name])
            full = gather_expert_state(shaped, groups=self.groups, totals=totals, first_replica_only=not everywhere)
            if full is not None:
                gathered[index] = {**state, **full}
        self._gathered_optimizer_state = gathered or None

    def _full_optimizer_state(self, optimizer, state_dict: dict) -> dict:
        gathered, self._gathered_optimizer_state = self._gathered_optimizer_state, None
        for index, state in (gathered or {}).items():
            if index in state_dict["state"]:
                state_dict["state"][index] = state
        return state_dict

    def _shard_optimizer_state(self, optimizer, state_dict: dict) -> dict:
        state = dict(state_dict["state"])
        for index, name in self._expert_indices(optimizer).items():
            if index in state:
                entry = state[index]
                shaped = {k for k, v in entry.items() if torch.is_tensor(v) and v.dim() > 0}
                state[index] = shard_expert_state(entry, dict.fromkeys(shaped, self.shards[name]))
        return {**state_dict, "state": state}

    # ---- Trainer hooks ----
    def clip_grad_norm(self, trainer: Any, model) -> torch.Tensor:
        """`Trainer._clip_grad_norm` with the norm over all experts (DDP; DeepSpeed clips itself)."""
        trainer.accelerator.unscale_gradients()  # fp16 GradScaler: clip the true gradients
        return clip_grad_norm_(
            model.parameters(), trainer.args.max_grad_norm, expert=self.expert_ids, groups=self.groups
        )

    def save_model(self, trainer: Any, output_dir: str | None, internal_call: bool) -> None:
        """`Trainer.save_model` on every rank: gather the expert shards, rank 0 writes the full native model."""
        output_dir = output_dir if output_dir is not None else trainer.args.output_dir
        everywhere = trainer.args.save_on_each_node  # then a rank of every node writes
        full = gather_expert_state(
            trainer.model.state_dict(), groups=self.groups, totals=self.totals, first_replica_only=not everywhere
        )
        if internal_call and trainer.optimizer is not None and not trainer.args.save_only_model:
            self.gather_optimizer_state(trainer.optimizer, everywhere=everywhere)  # optimizer.pt is written next
        if trainer.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            trainer._save(output_dir, state_dict=full)
        if trainer.args.push_to_hub and not internal_call:
            trainer.push_to_hub(commit_message="Model save", revision=trainer.args.hub_revision)


class ExpertParallelDDPKwargs:
    """Stands in for accelerate's `DistributedDataParallelKwargs` handler (`accelerator.ddp_handler`, which accelerate
    asks for `to_kwargs()` and `register_comm_hook(model)` when it wraps the model in DDP): the same DDP arguments
    without the start-up broadcast, and the expert-aware gradient reduction."""

    def __init__(
        self, base: DistributedDataParallelKwargs | None, *, expert_ids: set[int], groups: ExpertParallelGroups
    ):
        if base is not None and base.comm_hook != DDPCommunicationHookType.NO:
            raise ValueError(f"expert_parallel_size > 1 brings its own DDP communication hook; drop {base.comm_hook}")
        self.base, self.expert_ids, self.groups = base, expert_ids, groups

    def to_kwargs(self) -> dict:
        # The trainer broadcast dense weights and each expert shard from its own source before wrapping;
        # DDP's own start-up broadcast would overwrite every shard with rank 0's.
        return {**(self.base.to_kwargs() if self.base is not None else {}), "init_sync": False}

    def register_comm_hook(self, model) -> None:
        model.register_comm_hook(_HookState(self.expert_ids, self.groups), _expert_parallel_hook)


class _HookState:
    def __init__(self, expert_ids: set[int], groups: ExpertParallelGroups):
        self.expert_ids, self.groups = expert_ids, groups
        self.world = dist.get_world_size()
        self.split: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}  # bucket params -> (dense, expert)


def _expert_parallel_hook(state: _HookState, bucket):  # -> Future[Tensor]; DDP rejects string annotations
    """Average dense gradients over the world; sum expert shards over their replicas and divide by the world."""
    buffer, grads, params = bucket.buffer(), bucket.gradients(), bucket.parameters()
    # Keyed by the bucket's parameters, not its index: DDP rebuilds its buckets after the first step, and a rebuilt
    # bucket with an old index (even of the same length) holds other parameters; reading it with the old split
    # left dense gradients unreduced (the ranks' dense weights drifted apart from step 2 on).
    key = tuple(map(id, params))
    if key not in state.split:
        positions = ([], [])
        for i, param in enumerate(params):
            positions[id(param) in state.expert_ids].append(i)
        state.split[key] = positions
    dense, expert = state.split[key]
    parts = []
    for positions, group in ((dense, None), (expert, state.groups.replica_group)):
        if not positions:
            continue
        flat = buffer if len(positions) == len(grads) else torch.cat([grads[i].reshape(-1) for i in positions])
        flat.div_(state.world)
        if group is None or state.groups.num_replicas > 1:
            work = dist.all_reduce(flat, group=group, async_op=True)
            parts.append((flat, positions, work.get_future()))
        else:  # a single replica: nothing to sum
            parts.append((flat, positions, None))

    def write_back(_) -> torch.Tensor:
        for flat, positions, _fut in parts:
            if flat is not buffer:
                offset = 0
                for i in positions:
                    n = grads[i].numel()
                    grads[i].copy_(flat[offset : offset + n].view_as(grads[i]))
                    offset += n
        return buffer

    futures = [fut for _, _, fut in parts if fut is not None]
    if not futures:
        done = torch.futures.Future()
        done.set_result(write_back(None))
        return done
    return torch.futures.collect_all(futures).then(write_back)
