"""`BottleneckModel`: the peft tuner that injects bottleneck adapters."""

from __future__ import annotations

from peft.tuners.tuners_utils import BaseTuner
from torch import nn

from hf_llmkit.tuners.bottleneck.config import BOTTLENECK_TARGET_MODULES, BottleneckConfig
from hf_llmkit.tuners.bottleneck.layer import BottleneckLayer
from hf_llmkit.tuners.matching import check_targets_exist


class BottleneckModel(BaseTuner):
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
    target_module_mapping: dict = {}  # per placement, resolved in _prepare_adapter_config

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

    def _prepare_model(self, peft_config: BottleneckConfig, model: nn.Module) -> None:
        check_targets_exist(model, peft_config.target_modules, "BottleneckConfig")

    def _create_and_replace(
        self,
        peft_config: BottleneckConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        **kwargs,
    ) -> None:
        if isinstance(target, BottleneckLayer):
            target.update_layer(adapter_name, peft_config, key=current_key)
            return
        new_module = BottleneckLayer(target, adapter_name, peft_config, key=current_key)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)  # an added, inactive adapter is not trainable
        self._replace_module(parent, target_name, new_module, target)

    def _check_merge_allowed(self) -> None:
        super()._check_merge_allowed()
        BottleneckLayer.merge(None)  # raises the ValueError that names the alternatives

    def _replace_module(self, parent: nn.Module, child_name: str, new_module: nn.Module, child: nn.Module) -> None:
        if not hasattr(new_module, "base_layer") and not hasattr(child.get_base_layer(), "weight"):
            # Unloading an adapter that wrapped a whole block (parallel placement): put the block back as is;
            # peft's version would copy a `.weight` that a block does not have.
            setattr(parent, child_name, new_module)
            return
        super()._replace_module(parent, child_name, new_module, child)
