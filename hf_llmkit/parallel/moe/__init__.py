"""Mixture of experts: `MoELayer` (routing, fused experts, expert parallelism) and dense-to-MoE upcycling."""

from hf_llmkit.parallel.moe.expert_parallel import apply_expert_parallel
from hf_llmkit.parallel.moe.layer import MoEAux, MoELayer, moe_layers
from hf_llmkit.parallel.moe.router import TopKRouter, load_balancing_loss, router_z_loss
from hf_llmkit.parallel.moe.upcycle import supported_architectures, upcycle_to_moe, use_moe_layers

__all__ = [
    "MoEAux",
    "MoELayer",
    "TopKRouter",
    "apply_expert_parallel",
    "load_balancing_loss",
    "moe_layers",
    "router_z_loss",
    "supported_architectures",
    "upcycle_to_moe",
    "use_moe_layers",
]
