"""`BottleneckConfig`: bottleneck adapters (Houlsby, Pfeiffer, parallel) as a peft config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from transformers.activations import ACT2FN

from hf_llmkit.tuners.base import LayerSelectionConfig
from hf_llmkit.tuners.registration import LLMKitPeftType

PLACEMENTS = ("houlsby", "pfeiffer", "parallel")
DEFAULT_REDUCTION_FACTOR = 16

_DECODER_SEQUENTIAL = {"houlsby": ["self_attn.o_proj", "mlp.down_proj"], "pfeiffer": ["mlp.down_proj"]}
# Mixture-of-experts families: the experts are fused tensors, so sequential adapters wrap the whole sparse block.
_MOE_SEQUENTIAL = {"houlsby": ["self_attn.o_proj", "mlp"], "pfeiffer": ["mlp"]}
_MOE_FAMILIES = ("mixtral", "qwen2_moe")
# BERT's FFN output is `layer.N.output.dense`; the suffix `output.dense` alone would also match the attention's
# `attention.output.dense`, hence the regex for the FFN-only placements.
_BERT_FFN_OUT = r".*layer\.\d+\.output\.dense"

# Default `target_modules` per placement and model family. Sequential adapters wrap the module whose output they
# adapt; parallel adapters wrap the FFN (input: the FFN's input, output added to the FFN's output, He et al. 2022).
BOTTLENECK_TARGET_MODULES: dict[str, dict[str, Union[list[str], str]]] = {
    "houlsby": {
        **{family: _DECODER_SEQUENTIAL["houlsby"] for family in ("llama", "mistral", "qwen2")},
        **{family: _MOE_SEQUENTIAL["houlsby"] for family in _MOE_FAMILIES},
        "gpt2": ["attn.c_proj", "mlp.c_proj"],
        "bert": ["attention.output.dense", "output.dense"],
    },
    "pfeiffer": {
        **{family: _DECODER_SEQUENTIAL["pfeiffer"] for family in ("llama", "mistral", "qwen2")},
        **{family: _MOE_SEQUENTIAL["pfeiffer"] for family in _MOE_FAMILIES},
        "gpt2": ["mlp.c_proj"],
        "bert": _BERT_FFN_OUT,
    },
    "parallel": {
        **{family: ["mlp"] for family in ("llama", "mistral", "qwen2", *_MOE_FAMILIES)},
        "gpt2": ["mlp"],
        # BERT has no single hidden->hidden FFN module; the adapter sits beside the FFN's output projection.
        "bert": _BERT_FFN_OUT,
    },
}


@dataclass
class BottleneckConfig(LayerSelectionConfig):
    """Configuration of bottleneck adapters: `h + s * f(h W_down) W_up` (sequential) or beside a module (parallel).

    Args:
        target_modules (`list[str]` or `str`, *optional*):
            Modules to adapt: a regex matched against full module names, or a list of name suffixes. Default: the
            placement's modules for Llama/Mistral/Qwen2/GPT-2/BERT and Mixtral/Qwen2-MoE (there the whole sparse MoE
            block, whose experts are fused tensors; `BOTTLENECK_TARGET_MODULES`); other models must name them.
        placement (`str`):
            "houlsby": sequential adapters after the attention output projection and after the MLP; "pfeiffer":
            after the MLP only; "parallel": beside the module (input: the module's input), output scaled and added.
        bottleneck_size (`int`, *optional*):
            Width of the bottleneck. Exclusive with `reduction_factor`.
        reduction_factor (`float`, *optional*):
            Bottleneck width as hidden size / reduction_factor (default 16 when neither is given).
        non_linearity (`str`):
            Activation between the down and up projection, any name of `transformers.activations.ACT2FN`.
        dropout (`float`):
            Dropout on the adapter's input.
        scaling (`float`, *optional*):
            Multiplier of the adapter's output. Default 1.0, and 4.0 for the parallel placement (He et al. 2022).
        init_weights (`bool`):
            True: the up projection starts at zero, so the adapted model equals the base model. False: random init
            (non-identity), for tests.

    `exclude_modules`, `layers_to_transform`, `layers_pattern` and `modules_to_save` as in `LayerSelectionConfig`.
    """

    target_modules: Union[list[str], str] | None = field(
        default=None,
        metadata={
            "help": "Modules to adapt (regex or list of name suffixes); default per model family and placement."
        },
    )
    placement: str = field(
        default="houlsby",
        metadata={"help": "houlsby (after attention out + MLP), pfeiffer (after MLP), or parallel (beside module)."},
    )
    bottleneck_size: int | None = field(
        default=None, metadata={"help": "Bottleneck width; exclusive with reduction_factor."}
    )
    reduction_factor: float | None = field(
        default=None, metadata={"help": "Bottleneck width = hidden size / reduction_factor (default 16)."}
    )
    non_linearity: str = field(default="relu", metadata={"help": "Activation name from transformers' ACT2FN."})
    dropout: float = field(default=0.0, metadata={"help": "Dropout on the adapter input."})
    scaling: float | None = field(
        default=None, metadata={"help": "Adapter output multiplier (default 1.0; 4.0 for parallel)."}
    )
    init_weights: bool = field(
        default=True, metadata={"help": "Zero-init the up projection (identity at start); False = random init."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = LLMKitPeftType.BOTTLENECK
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} is not supported; use one of {PLACEMENTS}.")
        if self.bottleneck_size is not None and self.reduction_factor is not None:
            raise ValueError("Set either bottleneck_size or reduction_factor, not both.")
        if self.bottleneck_size is not None and self.bottleneck_size < 1:
            raise ValueError(f"bottleneck_size must be >= 1, got {self.bottleneck_size}.")
        if self.reduction_factor is not None and self.reduction_factor <= 0:
            raise ValueError(f"reduction_factor must be > 0 (e.g. 16), got {self.reduction_factor}.")
        if self.bottleneck_size is None and self.reduction_factor is None:
            self.reduction_factor = DEFAULT_REDUCTION_FACTOR
        if self.non_linearity not in ACT2FN:
            raise ValueError(f"non_linearity={self.non_linearity!r} is unknown; use one of {sorted(ACT2FN)}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}.")
        if self.scaling is None:
            self.scaling = 4.0 if self.placement == "parallel" else 1.0

    def bottleneck_for(self, hidden_size: int) -> int:
        """The bottleneck width for a module of `hidden_size` features."""
        if self.bottleneck_size is not None:
            return self.bottleneck_size
        return max(1, int(hidden_size // self.reduction_factor))
