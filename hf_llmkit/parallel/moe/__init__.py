"""Mixture of experts: `MoELayer` (routing, fused experts, expert parallelism), dense-to-MoE upcycling, and our
expert compute as transformers' `experts_implementation="llmkit"` (registered when this package is imported)."""

from hf_llmkit.parallel.moe.expert_parallel import apply_expert_parallel
from hf_llmkit.parallel.moe.layer import MoEAux, MoELayer, moe_layers
from hf_llmkit.parallel.moe.registry import EXPERTS_IMPLEMENTATION, register_experts_implementation
from hf_llmkit.parallel.moe.router import TopKRouter, load_balancing_loss, router_z_loss
from hf_llmkit.parallel.moe.routing_stats import moe_blocks
from hf_llmkit.parallel.moe.upcycle import supported_architectures, upcycle_to_moe, use_moe_layers

register_experts_implementation()

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "MoEAux",
    "MoELayer",
    "TopKRouter",
    "apply_expert_parallel",
    "load_balancing_loss",
    "moe_blocks",
    "moe_layers",
    "register_experts_implementation",
    "router_z_loss",
    "supported_architectures",
    "upcycle_to_moe",
    "use_moe_layers",
]
