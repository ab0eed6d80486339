"""PEFT methods registered with peft: one folder each, in peft's config/layer/model layout.

Each method's `__init__.py` calls `register_tuner(...)`; importing this package registers them all.
"""

from hf_llmkit.tuners.registration import extend_peft_type, register_tuner  # noqa: I001 (registration first)
from hf_llmkit.tuners.bitfit import BitFitConfig
from hf_llmkit.tuners.bottleneck import BottleneckConfig

__all__ = ["BitFitConfig", "BottleneckConfig", "extend_peft_type", "register_tuner"]
