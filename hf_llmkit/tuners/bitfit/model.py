"""`BitFitModel`: the peft tuner that makes (a subset of) the model's biases trainable."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from hf_llmkit.tuners.base import LLMKitTuner, refuse_packed_layers
from hf_llmkit.tuners.bitfit.config import BitFitConfig
from hf_llmkit.tuners.bitfit.layer import BitFitLayer, bias_shape
from hf_llmkit.tuners.matching import module_names, unwrapped


class BitFitModel(LLMKitTuner):
    """BitFit (Ben Zaken et al. 2022) for `get_peft_model`: only bias terms train.

    Example:
        >>> import hf_llmkit
        >>> from peft import get_peft_model
        >>> from hf_llmkit.testing import tiny_llama
        >>> model = get_peft_model(tiny_llama(), hf_llmkit.BitFitConfig(add_missing_biases=True))
        >>> merged = model.merge_and_unload()  # Linear layers now carry the trained biases
    """

    prefix: str = "bitfit_"
    tuner_layer_cls = BitFitLayer  # default targets are computed from the model (every eligible module)

    def _eligible(self, module: nn.Module, config: BitFitConfig) -> bool:
        base = unwrapped(module)
        if base is self._output_embeddings():
            return False
        return bias_shape(base, add_missing=config.add_missing_biases) is not None

    def _output_embeddings(self) -> nn.Module | None:
        get = getattr(self.model, "get_output_embeddings", None)
        out = get() if callable(get) else None
        return None if out is None else unwrapped(out)

    def _prepare_adapter_config(self, peft_config: BitFitConfig, model_config: dict) -> BitFitConfig:
        refuse_packed_layers(self.model, type(peft_config).__name__)  # before looking for their biases
        if peft_config.target_modules is None:
            # Every eligible module, written as the leaf names so the saved config stays short and portable.
            leaves = {
                name.rsplit(".", 1)[-1]
                for name in module_names(self.model)
                if self._eligible(self.model.get_submodule(name), peft_config)
            }
            if not leaves:
                raise ValueError(
                    "BitFit found no module with a bias; set add_missing_biases=True to add trainable biases to "
                    "the Linear layers (e.g. for Llama), or name target_modules."
                )
            peft_config.target_modules = leaves
        return peft_config

    def _prepare_model(self, peft_config: BitFitConfig, model: nn.Module) -> None:
        super()._prepare_model(peft_config, model)
        matches = super()._check_target_module_exists  # peft's name matching, before the bias check below
        matched = [n for n in module_names(model) if matches(peft_config, n)]
        if matched and not any(self._eligible(model.get_submodule(n), peft_config) for n in matched):
            raise ValueError(
                f"target_modules={peft_config.target_modules} only match modules without a bias (e.g. "
                f"{matched[0]!r}); set add_missing_biases=True to add trainable zero-initialised biases there."
            )

    def _check_target_module_exists(self, peft_config: BitFitConfig, key: str):
        found = super()._check_target_module_exists(peft_config, key)
        if not found:  # unmatched, or peft's (falsy) marker of an excluded module: hand it back unchanged
            return found
        return self._eligible(self.model.get_submodule(key), peft_config)

    def merge_and_unload(
        self, progressbar: bool = False, safe_merge: bool = False, adapter_names: list[str] | None = None
    ) -> nn.Module:
        """Fold the biases into the base model; biases added to bias-less layers are declared in its config.

        A Llama-style config builds its projections from `attention_bias` / `mlp_bias`: those flags are switched
        on (and the group's other projections get zero biases), so `save_pretrained` + `from_pretrained` of the
        merged model keeps the trained biases instead of silently dropping them.
        """
        added = [
            name
            for name, module in self.model.named_modules()
            if isinstance(module, BitFitLayer) and getattr(module.get_base_layer(), "bias", None) is None
        ]
        model = super().merge_and_unload(progressbar=progressbar, safe_merge=safe_merge, adapter_names=adapter_names)
        _declare_added_biases(model, [n for n in added if model.get_submodule(n).bias is not None])
        return model


_CONFIG_BIAS_FLAGS = {"self_attn": "attention_bias", "mlp": "mlp_bias"}  # Llama-style configs


def _declare_added_biases(model: nn.Module, added: list[str]) -> None:
    config = getattr(model, "config", None)
    groups, undeclared = set(), []
    for name in added:
        group = next((g for g in _CONFIG_BIAS_FLAGS if g in name.split(".")), None)
        if group is not None and hasattr(config, _CONFIG_BIAS_FLAGS[group]):
            groups.add(group)
        else:
            undeclared.append(name)
    for group in groups:
        setattr(config, _CONFIG_BIAS_FLAGS[group], True)
        for name, module in model.named_modules():  # the flag gives every projection of the group a bias
            if isinstance(module, nn.Linear) and module.bias is None and group in name.split("."):
                weight = module.weight
                dtype = weight.dtype if weight.dtype.is_floating_point else getattr(module, "compute_dtype", None)
                module.bias = nn.Parameter(torch.zeros(module.out_features, device=weight.device, dtype=dtype))
    if undeclared:
        warnings.warn(
            f"merge_and_unload gave {len(undeclared)} bias-less layers a bias that {type(model).__name__}'s config "
            f"cannot declare (e.g. {undeclared[0]}); save_pretrained + from_pretrained would drop them. Keep the "
            "BitFit adapter (PeftModel) for this model, or target only layers that already have biases.",
            stacklevel=3,
        )
