"""`BottleneckModel`: the peft tuner that injects bottleneck adapters."""

from __future__ import annotations

from hf_llmkit.tuners.base import LLMKitTuner
from hf_llmkit.tuners.bottleneck.config import BOTTLENECK_TARGET_MODULES, BottleneckConfig
from hf_llmkit.tuners.bottleneck.layer import BottleneckLayer


class BottleneckModel(LLMKitTuner):
    """Bottleneck adapters (Houlsby et al. 2019, Pfeiffer et al. 2021, He et al. 2022) for `get_peft_model`.

    Example:
        >>> import hf_llmkit
        >>> from peft import get_peft_model
        >>> from hf_llmkit.testing import tiny_llama
        >>> model = get_peft_model(tiny_llama(), hf_llmkit.BottleneckConfig(placement="pfeiffer", bottleneck_size=8))
        >>> model.print_trainable_parameters()  # doctest: +SKIP
    """

    prefix: str = "bottleneck_"
    tuner_layer_cls = BottleneckLayer

    def _prepare_adapter_config(self, peft_config: BottleneckConfig, model_config: dict) -> BottleneckConfig:
        if peft_config.target_modules is None:
            family = model_config.get("model_type")
            targets = BOTTLENECK_TARGET_MODULES[peft_config.placement].get(family)
            if targets is None:
                known = sorted(BOTTLENECK_TARGET_MODULES[peft_config.placement])
                raise ValueError(
                    f"No default bottleneck targets for model_type={family!r} (known: {known}); pass "
                    "target_modules, e.g. the attention output projection and the MLP output projection for "
                    "'houlsby', or the MLP block for 'parallel'."
                )
            peft_config.target_modules = targets if isinstance(targets, str) else set(targets)
        return peft_config
