"""`MoEArguments`: `--upcycle_moe` and the options of `upcycle_to_moe`, derived from its signature.

Each keyword parameter of `hf_llmkit.parallel.upcycle_to_moe` is a flag `--moe_<parameter>` with the parameter's
type, default and docstring help, so a parameter added there is a flag here with no edit.

    >>> model = moe_args.apply(model)  # the dense model, or with --upcycle_moe its MoE (Mixtral / Qwen2-MoE)
"""

from __future__ import annotations

import dataclasses

from torch import nn

from hf_llmkit.cli.feature_flags import FlagGroup
from hf_llmkit.cli.options import Option, arguments_class, build_from, function_options
from hf_llmkit.parallel.moe.upcycle import upcycle_to_moe

__all__ = ["MoEArguments"]

# upcycle_to_moe has no default expert count (a library caller always chooses); the main job's is Mixtral's.
COMMAND_DEFAULTS = {"num_experts": 8}
# Function parameters carry no metadata: the values that make sense, checked before any work.
BOUNDS = {
    "num_experts": {"ge": 1},
    "top_k": {"ge": 1},
    "capacity_factor": {"gt": 0, "bound_hint": "omit it for dropless routing"},
    "jitter_noise": {"ge": 0, "lt": 1},
    "shared_expert_intermediate_size": {"ge": 0},
}
MOE_OPTIONS = [
    dataclasses.replace(o, default=COMMAND_DEFAULTS.get(o.field, o.default), bounds=BOUNDS.get(o.field, {}))
    for o in function_options(upcycle_to_moe, prefix="moe_")
]
_SWITCH = Option(
    flag="upcycle_moe", field="upcycle_moe", type=bool, default=False,
    help="Upcycle the dense model into a mixture of experts (Mixtral / Qwen2-MoE) whose experts start as copies of "
    "each MLP; the trainer adds the routing losses.",
)  # fmt: skip


def _post_init(self) -> None:
    if not 1 <= self.moe_top_k <= self.moe_num_experts:
        raise ValueError(
            f"--moe_top_k {self.moe_top_k} must be between 1 and --moe_num_experts {self.moe_num_experts}"
        )


def _apply(self, model: nn.Module) -> nn.Module:
    """`model` unchanged, or with `--upcycle_moe` its upcycled MoE (raises ValueError for other architectures)."""
    return build_from(upcycle_to_moe, MOE_OPTIONS, vars(self), model=model) if self.upcycle_moe else model


def _describe(self) -> str | None:
    return f"{self.moe_num_experts} experts, top-{self.moe_top_k} (upcycled)" if self.upcycle_moe else None


MoEArguments = arguments_class(
    "MoEArguments",
    [_SWITCH, *MOE_OPTIONS],
    doc="Whether and how to upcycle the dense model into a mixture of experts before training.",
    module=__name__,
    namespace={
        "help_group": "mixture of experts",
        "flag_groups": (
            FlagGroup("--upcycle_moe true", tuple(o.flag for o in MOE_OPTIONS), lambda v: v["upcycle_moe"]),
        ),
        "__post_init__": _post_init,
        "apply": _apply,
        "describe": _describe,
    },
)
