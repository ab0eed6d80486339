"""Parallelism and sparse layers: mixture-of-experts (`MoELayer`, expert parallelism, `upcycle_to_moe`)."""

from hf_llmkit.parallel.groups import new_expert_parallel_group
from hf_llmkit.parallel.moe import MoEAux, MoELayer, moe_layers
from hf_llmkit.parallel.moe_router import TopKRouter, load_balancing_loss, router_z_loss
from hf_llmkit.parallel.upcycle import supported_architectures, upcycle_to_moe, use_moe_layers

__all__ = [
    "MoEAux",
    "MoELayer",
    "TopKRouter",
    "load_balancing_loss",
    "moe_layers",
    "new_expert_parallel_group",
    "router_z_loss",
    "supported_architectures",
    "upcycle_to_moe",
    "use_moe_layers",
]
