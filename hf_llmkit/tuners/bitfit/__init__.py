"""BitFit (bias-only fine-tuning) registered with peft as `BITFIT`."""

from hf_llmkit.tuners.bitfit.config import BITFIT_PAPER_SUBSET, BitFitConfig
from hf_llmkit.tuners.bitfit.layer import BitFitLayer
from hf_llmkit.tuners.bitfit.model import BitFitModel
from hf_llmkit.tuners.registration import register_tuner
from hf_llmkit.tuners.strict_loading import enforce_strict_loading

register_tuner(
    name="bitfit",
    config_cls=BitFitConfig,
    model_cls=enforce_strict_loading(BitFitModel),
    display_name="BitFit",
)

__all__ = ["BITFIT_PAPER_SUBSET", "BitFitConfig", "BitFitLayer", "BitFitModel"]
