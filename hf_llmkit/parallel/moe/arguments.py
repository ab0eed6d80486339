"""Command-line arguments for sparse upcycling (`HfArgumentParser`-ready).

A training script needs three lines:

    >>> parser = HfArgumentParser((..., MoEArguments, TrainingArguments))
    >>> model = moe_args.apply(model)  # the dense model, or its upcycled MoE (Mixtral / Qwen2-MoE) with --upcycle_moe
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from hf_llmkit.cli.feature_flags import FlagGroup


@dataclass
class MoEArguments:
    """Whether and how to upcycle the dense model into a mixture of experts before training.

    Args:
        upcycle_moe: Sparse upcycling: turn a dense Llama / Mistral / Qwen2 model into transformers' native MoE
            architecture (Mixtral / Qwen2-MoE) whose experts start as copies of each MLP (`upcycle_to_moe`).
            `LLMKitTrainer` then adds the routing losses (`--moe_aux_loss_coef`, `--moe_z_loss_coef`).
        moe_num_experts: experts per layer.
        moe_top_k: experts each token is routed to.
        moe_capacity_factor: per-expert capacity factor in training (default: dropless routing).
    """

    help_group: ClassVar[str] = "mixture of experts"
    flag_groups: ClassVar[tuple[FlagGroup, ...]] = (
        FlagGroup(
            "--upcycle_moe true",
            ("moe_num_experts", "moe_top_k", "moe_capacity_factor"),
            lambda values: values["upcycle_moe"],
        ),
    )

    upcycle_moe: bool = field(
        default=False, metadata={"help": "Upcycle the dense model into a mixture of experts (Mixtral / Qwen2-MoE)."}
    )
    moe_num_experts: int = field(default=8, metadata={"help": "--upcycle_moe: experts per layer."})
    moe_top_k: int = field(default=2, metadata={"help": "--upcycle_moe: experts per token."})
    moe_capacity_factor: float | None = field(
        default=None, metadata={"help": "--upcycle_moe: per-expert capacity factor in training (default: dropless)."}
    )

    def __post_init__(self):
        if not 1 <= self.moe_top_k <= self.moe_num_experts:
            raise ValueError(
                f"--moe_top_k {self.moe_top_k} must be between 1 and --moe_num_experts {self.moe_num_experts}"
            )
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ValueError(f"--moe_capacity_factor {self.moe_capacity_factor} must be > 0 (omit it for dropless)")

    def apply(self, model: nn.Module) -> nn.Module:
        """`model` unchanged, or with `--upcycle_moe` its upcycled MoE (raises ValueError for other architectures)."""
        if not self.upcycle_moe:
            return model
        from hf_llmkit.parallel.moe.upcycle import upcycle_to_moe

        return upcycle_to_moe(
            model, num_experts=self.moe_num_experts, top_k=self.moe_top_k, capacity_factor=self.moe_capacity_factor
        )
