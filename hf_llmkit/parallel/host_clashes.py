"""Where hf_llmkit's parallelism meets the host libraries' own: the pairs that cannot work together, refused before
any work in one line that names both settings and the fix.

- Our Ulysses (`sequence_parallel_size`) and accelerate's `ParallelismConfig` sequence / context parallelism
  (`sp_size`: DeepSpeed's Ulysses; `cp_size`: torch context parallel). Both would split the same sequence; without
  this check `train()` died inside `accelerator.prepare` with DeepSpeed's complaint about the attention name. The
  config comes from `TrainingArguments(parallelism_config=...)` or from `accelerate launch
  --parallelism_config_sp_size ...`, which only sets environment variables the `Accelerator` reads
  (`hf_llmkit.compat.accelerate.launcher_parallelism_config`); the trainer checks the accelerator's own config too.
- Our expert parallelism (`expert_parallel_size`) on a model transformers already distributed (loaded with
  `distributed_config=DistributedConfig(ep_size=...)` / `tp_plan`: its weights are DTensors). Sharding it again
  failed with `aten.copy_.default got mixed torch.Tensor and DTensor`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["check_expert_parallel_model", "check_sequence_parallel_config"]


def check_sequence_parallel_config(sequence_parallel_size: int, parallelism_config: Any, *, source: str) -> None:
    """Raise `ValueError` when our Ulysses (`sequence_parallel_size > 1`) meets an accelerate `ParallelismConfig`
    (`source`: where it came from, for the message) that splits the sequence too."""
    if sequence_parallel_size <= 1 or parallelism_config is None:
        return
    sp = getattr(parallelism_config, "sp_size", 1) or 1
    cp = getattr(parallelism_config, "cp_size", 1) or 1
    if sp > 1:
        backend = getattr(parallelism_config, "sp_backend", "deepspeed")
        owner = "DeepSpeed" if backend == "deepspeed" else backend
        raise ValueError(
            f"sequence_parallel_size={sequence_parallel_size} (hf_llmkit's Ulysses) and {source} "
            f"ParallelismConfig(sp_size={sp}, sp_backend={backend!r}) ({owner}'s Ulysses) both split the sequence: "
            "keep one -- drop sequence_parallel_size to use DeepSpeed's, or drop the config's sp_size "
            "(--parallelism_config_sp_size) to use ours"
        )
    if cp > 1:
        raise ValueError(
            f"sequence_parallel_size={sequence_parallel_size} (hf_llmkit's Ulysses) and {source} "
            f"ParallelismConfig(cp_size={cp}) (torch context parallel) both split the sequence: keep one -- drop "
            "sequence_parallel_size to use context parallelism, or drop the config's cp_size "
            "(--parallelism_config_cp_size) to use ours"
        )


def _distributed_by_host(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def check_expert_parallel_model(expert_parallel_size: int, model: nn.Module) -> None:
    """Raise `ValueError` when our expert parallelism (`expert_parallel_size > 1`) would shard a model whose
    weights transformers (or torch's tensor / FSDP2 plans) already distributed."""
    if expert_parallel_size > 1 and _distributed_by_host(model):
        raise ValueError(
            f"expert_parallel_size={expert_parallel_size} (hf_llmkit's expert parallelism) cannot shard "
            f"{type(model).__name__}: transformers already distributed it (loaded with distributed_config / tp_plan, "
            "its weights are DTensors) -- drop expert_parallel_size to train with transformers' own expert "
            "parallelism, or load the model without distributed_config to use ours"
        )
