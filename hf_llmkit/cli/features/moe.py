"""Mixture of experts: `--upcycle_moe` and its `--moe_*` options (`hf_llmkit.cli.moe`), the dense model upcycled
into Mixtral / Qwen2-MoE experts right after loading."""

from __future__ import annotations

from hf_llmkit.cli.feature_flags import FlagGroup
from hf_llmkit.cli.features.base import BuildState, Feature
from hf_llmkit.cli.moe import MoEArguments

__all__ = ["MOE"]


class MoE(Feature):
    name = "moe"
    arguments = MoEArguments
    # the routing losses' weights are LLMKitTrainingArguments fields, acting only on an upcycled model
    flag_groups = (
        FlagGroup("--upcycle_moe true", ("moe_aux_loss_coef", "moe_z_loss_coef"), lambda v: v["upcycle_moe"]),
    )
    stage = 10  # first: every later stage sees the experts
    row = "mixture of experts"

    def check(self, args) -> None:
        if args.moe.upcycle_moe and args.training.tiled_mlp and args.moe.moe_capacity_factor is not None:
            raise ValueError(
                "--tiled_mlp cannot tile experts with --moe_capacity_factor (the capacity is per call, so chunks "
                "would drop other tokens); omit --moe_capacity_factor for dropless routing, or drop --tiled_mlp"
            )

    def folder_suffix(self, values):
        return "moe" if values["upcycle_moe"] else None

    def model_stage(self, args, state: BuildState) -> None:
        state.model = args.moe.apply(state.model)  # --upcycle_moe: dense -> Mixtral / Qwen2-MoE experts

    def describe(self, args):
        return args.moe.describe()


MOE = MoE()
