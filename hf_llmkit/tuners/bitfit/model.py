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

    def undeclarable_biases(self) -> list[str]:
        """The targeted bias-less layers whose merged bias the model's config cannot declare (Qwen2's `o_proj`, every
        Mistral projection): `save_pretrained` + `from_pretrained` of the merged model would drop them."""
        return _config_flags(self.model, self._added_biases())[1]

    def _added_biases(self) -> list[str]:
        return [
            name
            for name, module in self.model.named_modules()
            if isinstance(module, BitFitLayer) and getattr(module.get_base_layer(), "bias", None) is None
        ]

    def merge_and_unload(
        self, progressbar: bool = False, safe_merge: bool = False, adapter_names: list[str] | None = None
    ) -> nn.Module:
        """Fold the biases into the base model; biases added to bias-less layers are declared in its config.

        A Llama-style config builds its projections from `attention_bias` / `mlp_bias`: those flags are switched
        on (and the group's other projections get zero biases), so `save_pretrained` + `from_pretrained` of the
        merged model keeps the trained biases instead of silently dropping them. Where no flag of the config
        gives a layer its bias (`undeclarable_biases()`), the merge warns.
        """
        added = self._added_biases()
        flags, undeclared = _config_flags(self.model, added)
        model = super().merge_and_unload(progressbar=progressbar, safe_merge=safe_merge, adapter_names=adapter_names)
        _declare(model, flags)
        if undeclared:
            warnings.warn(
                f"merge_and_unload gave {len(undeclared)} bias-less layers a bias that {type(model).__name__}'s "
                f"config cannot declare (e.g. {undeclared[0]}); save_pretrained + from_pretrained would drop them. "
                "Keep the BitFit adapter (PeftModel) for this model, or target only layers that already have biases.",
                stacklevel=2,
            )
        return model


_CONFIG_BIAS_FLAGS = ("attention_bias", "mlp_bias")  # Llama-style configs (Llama, Gemma, Qwen3, OLMo: attention)


def _biased_linears(model_cls: type, config: object) -> set[str] | None:
    """The names of the Linear layers with a bias in a `model_cls` built from `config` on the meta device (no
    memory, no initialisation work); None where the class cannot be built that way."""
    try:
        with torch.device("meta"):
            built = model_cls(config)
    except Exception:  # noqa: BLE001 - not a transformers model built from its config: nothing is declarable
        return None
    return {n for n, m in built.named_modules() if isinstance(m, nn.Linear) and m.bias is not None}


def _config_flags(model: nn.Module, added: list[str]) -> tuple[dict[str, set[str]], list[str]]:
    """The config flags that give the `added` layers a bias when the model is built from its config (each with the
    layers it gives one), and the added layers no flag covers. The flags are tried on the real class (a Qwen2
    config that were to carry `attention_bias` still builds `o_proj` without a bias)."""
    config = getattr(model, "config", None)
    candidates = [f for f in _CONFIG_BIAS_FLAGS if getattr(config, f, None) is False]
    if not added or not candidates:
        return {}, list(added)
    import copy

    before = _biased_linears(type(model), config)
    flags = {}
    for flag in candidates:
        changed = copy.deepcopy(config)
        setattr(changed, flag, True)
        after = _biased_linears(type(model), changed)
        gained = (after - before) if before is not None and after is not None else set()
        if gained & set(added):
            flags[flag] = gained
    covered = set().union(*flags.values())
    return flags, [n for n in added if n not in covered]


def _declare(model: nn.Module, flags: dict[str, set[str]]) -> None:
    """Switch the `flags` on in the merged model's config and give the other layers they cover a zero bias."""
    for flag, names in flags.items():
        setattr(model.config, flag, True)
        for name in names:
            module = model.get_submodule(name)
            if module.bias is None:
                weight = module.weight
                dtype = weight.dtype if weight.dtype.is_floating_point else getattr(module, "compute_dtype", None)
                module.bias = nn.Parameter(torch.zeros(module.out_features, device=weight.device, dtype=dtype))
