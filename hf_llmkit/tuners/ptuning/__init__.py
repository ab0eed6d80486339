"""P-tuning v1 ("GPT Understands, Too") registered with peft as `PTUNING`: a prompt encoder behind virtual tokens."""

from hf_llmkit.tuners.ptuning.config import PTuningConfig
from hf_llmkit.tuners.ptuning.encoder import PromptEncoder
from hf_llmkit.tuners.ptuning.layer import PTuningEmbedding, PTuningLayer
from hf_llmkit.tuners.ptuning.model import PTuningModel
from hf_llmkit.tuners.ptuning.template import PTuningTemplate, build_ptuning_template
from hf_llmkit.tuners.registration import register_tuner
from hf_llmkit.tuners.strict_loading import enforce_strict_loading

register_tuner(
    name="ptuning",
    config_cls=PTuningConfig,
    model_cls=enforce_strict_loading(PTuningModel),
    display_name="P-tuning v1",
    summary="{num_virtual_tokens} virtual tokens",
)

__all__ = [
    "PTuningConfig",
    "PTuningEmbedding",
    "PTuningLayer",
    "PTuningModel",
    "PTuningTemplate",
    "PromptEncoder",
    "build_ptuning_template",
]
