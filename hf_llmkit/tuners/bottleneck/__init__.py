"""Bottleneck adapters (Houlsby / Pfeiffer / parallel) registered with peft as `BOTTLENECK`."""

from hf_llmkit.tuners.bottleneck.config import BOTTLENECK_TARGET_MODULES, PLACEMENTS, BottleneckConfig
from hf_llmkit.tuners.bottleneck.layer import BottleneckLayer
from hf_llmkit.tuners.bottleneck.model import BottleneckModel
from hf_llmkit.tuners.registration import register_tuner
from hf_llmkit.tuners.strict_loading import enforce_strict_loading

register_tuner(
    name="bottleneck",
    config_cls=BottleneckConfig,
    model_cls=enforce_strict_loading(BottleneckModel),
    display_name="bottleneck",
    summary="{placement}",
)

__all__ = ["BOTTLENECK_TARGET_MODULES", "PLACEMENTS", "BottleneckConfig", "BottleneckLayer", "BottleneckModel"]
