"""PEFT methods registered with peft: one folder each, in peft's config/layer/model layout.

Each method's `__init__.py` calls `register_tuner(...)`; importing this package registers them all.
"""

from hf_llmkit.tuners.registration import LLMKitPeftType, register_tuner  # noqa: I001 (registration first)
from hf_llmkit.tuners.bitfit import BitFitConfig
from hf_llmkit.tuners.bottleneck import BottleneckConfig
from hf_llmkit.tuners.ptuning import PTuningConfig
from hf_llmkit.tuners.ptuning_v2 import PTuningV2Config

__all__ = [
    "BitFitConfig",
    "BottleneckConfig",
    "LLMKitPeftType",
    "PTuningConfig",
    "PTuningV2Config",
    "register_tuner",
]
