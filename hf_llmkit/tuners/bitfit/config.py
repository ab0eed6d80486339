"""`BitFitConfig`: train only bias terms (Ben Zaken et al. 2022) as a peft config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from hf_llmkit.tuners.base import LayerSelectionConfig
from hf_llmkit.tuners.registration import LLMKitPeftType

# The BitFit paper's small subset (its Table 3): the query bias and the FFN's intermediate bias (BERT naming).
BITFIT_PAPER_SUBSET = ["attention.self.query", "intermediate.dense"]


@dataclass
class BitFitConfig(LayerSelectionConfig):
    """Configuration of BitFit: every targeted module's bias is trained; all other weights stay frozen.

    The adapter stores a bias *delta* per module (zero at init), added to the module's output; the base biases
    stay untouched, so several adapters, `disable_adapter()` and `unload()` behave as in peft, and
    `merge_and_unload()` adds the delta to the base bias (exact).

    Args:
        target_modules (`list[str]` or `str`, *optional*):
            Modules whose bias is trained: a regex matched against full module names, or a list of name suffixes.
            Default: every Linear / Conv1D / LayerNorm that has a bias (plus bias-less Linear layers when
            `add_missing_biases`), except the output embedding. `BITFIT_PAPER_SUBSET` is the paper's
            query-bias + intermediate-bias subset for BERT models.
        add_missing_biases (`bool`):
            Also train a bias for targeted Linear layers that have none (e.g. Llama); it starts at zero, and
            `merge_and_unload()` gives those layers a real bias. False: bias-less modules are skipped.
        init_weights (`bool`):
            True: the bias deltas start at zero (the adapted model equals the base model). False: random
            non-zero deltas, for tests.

    `exclude_modules`, `layers_to_transform`, `layers_pattern` and `modules_to_save` as in `LayerSelectionConfig`.
    """

    target_modules: Union[list[str], str] | None = field(
        default=None,
        metadata={"help": "Modules whose bias is trained (regex or list of name suffixes); default: all with a bias."},
    )
    add_missing_biases: bool = field(
        default=False, metadata={"help": "Add zero-initialised trainable biases to targeted bias-less Linear layers."}
    )
    init_weights: bool = field(
        default=True, metadata={"help": "Zero-init the bias deltas (identity at start); False = random init."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = LLMKitPeftType.BITFIT
        if self.target_modules is not None and len(self.target_modules) == 0:
            raise ValueError("target_modules is empty; pass None to train every bias, or name the modules.")
