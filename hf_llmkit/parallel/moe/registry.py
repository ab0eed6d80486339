"""hf_llmkit's expert compute as a transformers experts implementation: `experts_implementation="llmkit"`.

transformers' MoE models (Mixtral, Qwen2-MoE, ...) keep their experts as fused tensors (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`) in a module whose forward dispatches through the `ExpertsInterface` registry on
`config._experts_implementation` ("grouped_mm" by default). Importing hf_llmkit registers `"llmkit"` there: the
same routing (the model's own router and sparse block run unchanged), with `MoELayer`'s expert compute -- tokens
copied into expert-sorted rows and back with row gathers (`dispatch.tokens_to_rows` / `rows_to_tokens`), one
matmul per expert on its own rows in cache-sized tiles, SwiGLU in one C pass on float32 CPU tiles, weight gradients
in reused memory.

    model = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="llmkit")
    model.set_experts_implementation("llmkit")   # or on a loaded model

Because the block stays transformers' own, everything transformers and DeepSpeed apply to it keeps working:
transformers' expert-parallel plan (`DistributedConfig(ep_size=...)`, whose experts module then holds `E / P`
experts and marks routes to other ranks' experts with ids `>= E / P`: those slots are dropped here, as a capacity
limit drops them in `MoELayer`), tensor-parallel plans, FSDP2, DeepSpeed AutoEP, and `save_pretrained` of the
native checkpoint. What a registry function cannot do is change the routing: capacity limits, our own expert
parallelism (`expert_parallel_size`) and router jitter where the block has none (Qwen2-MoE) swap the block for an
`MoELayer` (`use_moe_layers`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from hf_llmkit.compat.transformers import experts_layout_problem
from hf_llmkit.parallel.moe.dispatch import rows_to_tokens, slot_positions, tokens_to_rows
from hf_llmkit.parallel.moe.experts import grouped_swiglu
from hf_llmkit.parallel.moe.grad_buffers import GradientBuffer

EXPERTS_IMPLEMENTATION = "llmkit"
_BUFFERS = "_llmkit_grad_buffers"  # the weight gradients' reused memory, kept on the experts module


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's part of an expert weight (a DTensor under transformers' expert-parallel plan)."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if callable(to_local) else weight


def llmkit_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, K] expert of each (token, slot); >= num_experts: not on this rank
    top_k_weights: torch.Tensor,  # [T, K]
) -> torch.Tensor:
    """The `ExpertsInterface` function: the weighted sum of each token's experts' outputs, `[T, H]`."""
    problem = experts_layout_problem(self)
    if problem is not None:
        raise ValueError(
            f"experts_implementation={EXPERTS_IMPLEMENTATION!r} computes SwiGLU experts with fused [gate | up] "
            f"weights; {type(self).__name__} {problem}: use experts_implementation='grouped_mm' for this model"
        )
    num_tokens, k = top_k_index.shape
    num_experts = self.num_experts  # this rank's experts under transformers' expert parallelism
    with torch.no_grad():
        flat = top_k_index.reshape(-1)  # [T*K]
        local = flat < num_experts
        counts = torch.bincount(flat[local], minlength=num_experts)  # [E]
        order = torch.argsort(flat, stable=True)[: int(counts.sum())]  # rows grouped by expert; other ranks' last
        pos = slot_positions(order, flat.numel())  # [T*K] row of each slot (past the end: dropped, reads zero)
    buffers = self.__dict__.get(_BUFFERS)
    if buffers is None:
        buffers = self.__dict__[_BUFFERS] = (GradientBuffer(), GradientBuffer())
    rows = tokens_to_rows(hidden_states, order, pos, k)  # [N, H] sorted by expert
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    out_rows = grouped_swiglu(rows, gate_up, down, counts.tolist(), self.config.hidden_act, buffers)
    out = rows_to_tokens(out_rows, top_k_weights.to(out_rows.dtype), order, pos)  # [T, H]
    return out.to(hidden_states.dtype)


def register_experts_implementation() -> str:
    """Register `"llmkit"` with transformers' `ExpertsInterface` (idempotent); returns the name."""
    if ExpertsInterface().get(EXPERTS_IMPLEMENTATION) is not llmkit_experts_forward:
        ExpertsInterface.register(EXPERTS_IMPLEMENTATION, llmkit_experts_forward)
    return EXPERTS_IMPLEMENTATION
