"""P-tuning v2 (deep prompt tuning) registered with peft as `PTUNING_V2`: prefix keys/values in every layer."""

from hf_llmkit.tuners.ptuning_v2.attention import register_prefix_attention
from hf_llmkit.tuners.ptuning_v2.config import PTuningV2Config
from hf_llmkit.tuners.ptuning_v2.layer import PTuningV2Attention, PTuningV2Layer
from hf_llmkit.tuners.ptuning_v2.model import PTuningV2Model
from hf_llmkit.tuners.ptuning_v2.prefix import PlainPrefix, ProjectedPrefix
from hf_llmkit.tuners.registration import register_tuner
from hf_llmkit.tuners.strict_loading import enforce_strict_loading

register_tuner(
    name="ptuning_v2",
    config_cls=PTuningV2Config,
    model_cls=enforce_strict_loading(PTuningV2Model),
    display_name="P-tuning v2",
    summary="{num_virtual_tokens} prefix tokens per layer",
)

__all__ = [
    "PTuningV2Attention",
    "PTuningV2Config",
    "PTuningV2Layer",
    "PTuningV2Model",
    "PlainPrefix",
    "ProjectedPrefix",
    "register_prefix_attention",
]
