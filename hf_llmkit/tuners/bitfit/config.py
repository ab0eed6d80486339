"""`BitFitConfig`: train only bias terms (Ben Zaken et al. 2022) as a peft config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from peft.config import PeftConfig

from hf_llmkit.tuners.registration import LLMKitPeftType

# The BitFit paper's small subset (its Table 3): the query bias and the FFN's intermediate bias (BERT naming).
BITFIT_PAPER_SUBSET = ["attention.self.query", "intermediate.dense"]


@dataclass
class BitFitConfig(PeftConfig):
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
        exclude_modules (`list[str]` or `str`, *optional*):
            Modules never adapted, same matching rules as `target_modules`.
        add_missing_biases (`bool`):
            Also train a bias for targeted Linear layers that have none (e.g. Llama); it starts at zero, and
            `merge_and_unload()` gives those layers a real bias. False: bias-less modules are skipped.
        init_weights (`bool`):
            True: the bias deltas start at zero (the adapted model equals the base model). False: random
            non-zero deltas, for tests.
        layers_to_transform (`list[int]` or `int`, *optional*):
            Only adapt these layer indices.
        layers_pattern (`list[str]` or `str`, *optional*):
            Name of the layer list used with `layers_to_transform` (e.g. "layers", "h").
        modules_to_save (`list[str]`, *optional*):
            Extra modules trained in full and saved with the adapter (e.g. a classifier head).
    """

    target_modules: Union[list[str], str] | None = field(
        default=None,
        metadata={"help": "Modules whose bias is trained (regex or list of name suffixes); default: all with a bias."},
    )
    exclude_modules: Union[list[str], str] | None = field(
        default=None, metadata={"help": "Modules never adapted (regex or list of name suffixes)."}
    )
    add_missing_biases: bool = field(
        default=False, metadata={"help": "Add zero-initialised trainable biases to targeted bias-less Linear layers."}
    )
    init_weights: bool = field(
        default=True, metadata={"help": "Zero-init the bias deltas (identity at start); False = random init."}
    )
    layers_to_transform: Union[list[int], int] | None = field(
        default=None, metadata={"help": "Only adapt these layer indices."}
    )
    layers_pattern: Union[list[str], str] | None = field(
        default=None, metadata={"help": "Layer list name used with layers_to_transform (e.g. 'layers')."}
    )
    modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Extra modules trained in full and saved with the adapter."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = LLMKitPeftType.BITFIT
        if isinstance(self.target_modules, list):
            self.target_modules = set(self.target_modules)
        if isinstance(self.exclude_modules, list):
            self.exclude_modules = set(self.exclude_modules)
        if self.target_modules is not None and len(self.target_modules) == 0:
            raise ValueError("target_modules is empty; pass None to train every bias, or name the modules.")
        if self.layers_pattern and self.layers_to_transform is None:
            raise ValueError("layers_pattern only applies with layers_to_transform; set layers_to_transform too.")
