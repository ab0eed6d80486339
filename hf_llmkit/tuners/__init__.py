"""PEFT methods registered with peft: one folder each, in peft's config/layer/model layout.

Each method's `__init__.py` calls `register_tuner(...)`; importing this package registers them all, in the order
`PEFT_METHODS` lists them (after peft's LoRA): the order of `--peft_method` choices and of the composition matrix.
"""

from hf_llmkit.tuners.registration import PEFT_METHODS, LLMKitPeftType, PeftMethod, register_tuner  # noqa: I001
from hf_llmkit.tuners.bottleneck import BottleneckConfig
from hf_llmkit.tuners.bitfit import BitFitConfig
from hf_llmkit.tuners.ptuning import PTuningConfig
from hf_llmkit.tuners.ptuning_v2 import PTuningV2Config

__all__ = [
    "BitFitConfig",
    "BottleneckConfig",
    "LLMKitPeftType",
    "PEFT_METHODS",
    "PTuningConfig",
    "PTuningV2Config",
    "PeftMethod",
    "register_tuner",
]
