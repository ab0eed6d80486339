"""The peers of benchmarks/sequence_parallel.py, set up the way DeepSpeed documents them (deepspeed 0.19.8).

- DeepSpeed Ulysses: `UlyssesSPAttentionHF`, through accelerate's `ParallelismConfig(sp_backend="deepspeed")`,
  the route `transformers.Trainer` takes; the prepared DeepSpeed engine (ZeRO stage 0).
- DeepSpeed ALST: that Ulysses attention (sp > 1) plus DeepSpeed's `TiledMLP` and `TiledFusedLogitsLoss`
  (`deepspeed.runtime.sequence_parallel.ulysses_sp`) and transformers' activation checkpointing -- the pieces of
  Arctic Long Sequence Training that DeepSpeed ships. DeepSpeed's docs install `TiledMLP` by replacing
  `LlamaMLP.forward` on the class; here it replaces `forward` on this benchmark's model instances only.

DeepSpeed's Ulysses replaces `"sdpa"` in transformers' shared `ALL_ATTENTION_FUNCTIONS` for the whole process (its
"Being John Malkovich" registration), and accelerate allows one DeepSpeed `Accelerator` per process; so the ALST
peer is a plain model with sdpa that runs through that same replaced entry (checked by `ulysses_is_registered`).
"""

from __future__ import annotations

import math
import os
import types

import torch
import torch.nn.functional as F

from hf_llmkit.parallel.sequence.data import IGNORE_INDEX
from hf_llmkit.parallel.sequence.tiled_mlp import mlp_modules


def deepspeed_ulysses(model: torch.nn.Module, world: int):
    """`model` under DeepSpeed's HF Ulysses via accelerate `ParallelismConfig(sp_backend="deepspeed")`: the engine."""
    from accelerate import Accelerator, PartialState
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig

    # Without an accelerator, PartialState finds no DeepSpeed backend and reports 1 process: configure it on gloo.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo" if next(model.parameters()).device.type == "cpu" else None)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")
    accelerator = Accelerator(
        parallelism_config=ParallelismConfig(sp_size=world, sp_backend="deepspeed", sp_handler=handler),
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config),
    )
    engine, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    return engine


def ulysses_is_registered() -> bool:
    """Whether DeepSpeed's Ulysses wrapper now stands in for `"sdpa"` in this process."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return getattr(ALL_ATTENTION_FUNCTIONS.get("sdpa"), "__name__", "") == "uattn_wrapper"


def deepspeed_tiled_mlp(model: torch.nn.Module, *, chunk_size: int) -> None:
    """DeepSpeed's `TiledMLP` on every decoder-layer MLP of `model` (its documented recipe, per instance)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    for mlp in mlp_modules(model):
        plain = type(mlp).forward

        def tiled(self, x, plain=plain):
            shards = max(1, math.ceil(x.shape[1] / chunk_size))
            return TiledMLP.apply(plain, self, x, shards, list(self.parameters()))

        mlp.forward = types.MethodType(tiled, mlp)


def deepspeed_tiled_loss_sum(model: torch.nn.Module, inputs: dict, targets: torch.Tensor, *, chunk_size: int):
    """The decoder's hidden states, then DeepSpeed's `TiledFusedLogitsLoss` (sum over tokens) on them."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    hidden = model.model(**inputs).last_hidden_state  # [B, S, H]
    head = model.lm_head

    def chunk_sum(head, x, y):
        logits = head(x).float()
        flat = logits.view(-1, logits.shape[-1])
        return F.cross_entropy(flat, y.view(-1), ignore_index=IGNORE_INDEX, reduction="sum")

    shards = max(1, math.ceil(hidden.shape[1] / chunk_size))
    return TiledFusedLogitsLoss.apply(chunk_sum, head, hidden, targets, None, shards, [head.weight], "sum")
