"""Configuration of P-tuning v2 (deep prompt tuning, Liu et al. 2022) as a layer-injecting peft method."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from hf_llmkit.tuners.base import SavedModulesConfig
from hf_llmkit.tuners.registration import LLMKitPeftType


@dataclass
class PTuningV2Config(SavedModulesConfig):
    """Configuration of P-tuning v2: trainable prefix keys/values prepended to the attention of every layer.

    The prefixes enter through a registered `transformers` attention function that wraps the model's own (sdpa,
    eager, ...), not through `past_key_values`, so gradient checkpointing, GQA models and cached generation work.

    Args:
        num_virtual_tokens (`int`): Prefix length: key/value vectors per layer and key/value head (>= 1).
        prefix_projection (`bool`): Reparameterise each layer's prefix by an MLP over trainable embeddings while
            training (more stable optimisation); `save_pretrained` also writes the folded plain prefixes, which is
            what inference (and `PeftModel.from_pretrained` without `is_trainable`) uses.
        encoder_hidden_size (`int`, *optional*): Hidden size of the projection MLP; defaults to the model's hidden
            size.
        save_projection (`bool`): With `prefix_projection`, also save the MLP and its embeddings so training can
            resume with them (`is_trainable=True`). `False` saves only the folded prefixes (smaller adapter).
        init_std (`float`): Standard deviation of the initial prefixes (plain) or prefix embeddings (projection).
        target_modules (`str` or `list[str]`, *optional*): The attention modules to give prefixes; defaults to every
            module of the model that is a `transformers` attention layer (a `*Attention` module with `layer_idx`).

    `modules_to_save` and `ensure_weight_tying` as in `SavedModulesConfig`.
    """

    num_virtual_tokens: int = field(default=20, metadata={"help": "Prefix length per layer and key/value head."})
    prefix_projection: bool = field(
        default=False,
        metadata={"help": "Reparameterise the prefixes by an MLP while training; saved folded for inference."},
    )
    encoder_hidden_size: int | None = field(
        default=None, metadata={"help": "Hidden size of the projection MLP; defaults to the model's hidden size."}
    )
    save_projection: bool = field(
        default=True,
        metadata={"help": "With prefix_projection, also save the MLP so training can resume with it."},
    )
    init_std: float = field(default=1.0, metadata={"help": "Std of the initial prefixes (or prefix embeddings)."})
    target_modules: Union[list[str], str] | None = field(
        default=None,
        metadata={"help": "Attention modules to give prefixes; defaults to every transformers attention layer."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = LLMKitPeftType.PTUNING_V2
        if not isinstance(self.num_virtual_tokens, int) or self.num_virtual_tokens < 1:
            raise ValueError(f"num_virtual_tokens must be an int >= 1, got {self.num_virtual_tokens!r}")
        if self.encoder_hidden_size is not None and self.encoder_hidden_size < 1:
            raise ValueError(f"encoder_hidden_size must be >= 1 (or None), got {self.encoder_hidden_size}")
        if self.encoder_hidden_size is not None and not self.prefix_projection:
            raise ValueError("encoder_hidden_size only applies with prefix_projection=True; set it or drop the size")
        if not self.init_std > 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")
        if isinstance(self.target_modules, list):
            self.target_modules = set(self.target_modules)
