"""peft internals hf_llmkit relies on (checked against peft 0.21.2).

1. Registering a method from outside peft. `peft.utils.register_peft_method` accepts only members of peft's closed
   `PeftType` enum, but everything that reads a config's `peft_type` accepts any value equal to the string saved in
   `adapter_config.json` (the field is typed `str | PeftType`; peft's maintainers keep custom string types working,
   peft#2634 / #2635). hf_llmkit gives its methods their own `(str, Enum)` and writes the four tables
   `register_peft_method` writes: `register_method` / `unregister_method` below. Three of the tables are in
   `peft.__all__`; `PEFT_TYPE_TO_PREFIX_MAPPING` is a public name of `peft.mapping` without being exported.
2. The `BaseTuner` / `BaseTunerLayer` members our tuners override or call. peft documents only
   `_create_and_replace` as abstract; the others are internal hooks (peft's own comment on the state-dict ones: "These
   hooks are internal API"). A renamed hook would silently stop being called, so each is listed here with the
   reason we need it, and tests/compat/test_peft.py fails when one disappears or changes its parameters.
"""

from __future__ import annotations

CHECKED_AGAINST = "0.21.2"

# The tables `peft.utils.register_peft_method` fills, by name in `peft.mapping`.
MAPPING_TABLES = (
    "PEFT_TYPE_TO_CONFIG_MAPPING",
    "PEFT_TYPE_TO_TUNER_MAPPING",
    "PEFT_TYPE_TO_MIXED_MODEL_MAPPING",
    "PEFT_TYPE_TO_PREFIX_MAPPING",
)

# BaseTuner members: name -> (parameters after self/cls, why hf_llmkit needs it)
BASE_TUNER_HOOKS: dict[str, tuple[tuple[str, ...], str]] = {
    "_create_and_replace": (
        ("peft_config", "adapter_name", "target", "target_name", "parent", "current_key"),
        "wrap each target in our layer (abstract in peft)",
    ),
    "_prepare_adapter_config": (("peft_config", "model_config"), "default target_modules computed from the model"),
    "_prepare_model": (("peft_config", "model"), "fail before injection, naming close module names"),
    "_check_target_module_exists": (
        ("peft_config", "key"),
        "never target what another adapter's modules_to_save wraps; BitFit skips matched modules without a bias",
    ),
    "_check_merge_allowed": ((), "methods that cannot merge refuse with a message naming unload()"),
    "_check_tied_modules": (("model", "peft_config"), "P-tuning keeps tied embeddings tied without a warning"),
    "_replace_module": (
        ("parent", "child_name", "new_module", "child"),
        "unloading a wrapped block or a modules_to_save wrapper: no .weight to copy back",
    ),
    "_add_modules_to_save_to_tie": (
        ("peft_config", "tied_weight_keys"),
        "ensure_weight_tying: one trained copy for tied embeddings listed in modules_to_save (as LoRA's)",
    ),
    "_post_injection_hook": (
        ("model", "config", "adapter_name"),
        "every method installs its strict-loading hooks there; P-tuning v2 also switches the attention function",
    ),
    "_enable_adapter_layers": (("enabled",), "P-tuning v2 switches the attention function back and forth"),
    "_unload_and_optionally_merge": (
        ("merge", "progressbar", "safe_merge", "adapter_names"),
        "P-tuning v2 restores the model's attention implementation on unload()",
    ),
    "_get_adapter_state_dict": (
        ("model", "config", "adapter_name", "state_dict", "unwanted_adapter_names"),
        "P-tuning v2 saves folded prefixes computed from the (ZeRO-3 gathered) tensors",
    ),
    "_remap_adapter_state_dict_for_load": (
        ("model", "config", "adapter_name", "state_dict"),
        "P-tuning v2 loads folded or projected prefixes into the matching module",
    ),
    "_remove_adapter_name_from_key": (
        ("key", "adapter_name"),
        "adapter state that is a whole module (P-tuning's encoder) has keys deeper than peft's default strips",
    ),
}

# BaseTunerLayer members every tuner layer sets or calls: name -> why
BASE_TUNER_LAYER_MEMBERS: dict[str, str] = {
    "_disable_adapters": "read by the public `disable_adapters` property; every layer initialises it",
    "_active_adapter": "read by the public `active_adapters` property; every layer initialises it",
    "_move_adapter_to_device_of_base_layer": "new adapter weights follow the base layer's device (meta aware)",
}


def register_method(
    *, peft_type: str, config_cls: type, model_cls: type, prefix: str, is_mixed_compatible: bool = False
) -> None:
    """Write `peft_type` into the tables `peft.utils.register_peft_method` fills (no checks: the caller's)."""
    from peft import mapping

    mapping.PEFT_TYPE_TO_PREFIX_MAPPING[peft_type] = prefix
    mapping.PEFT_TYPE_TO_CONFIG_MAPPING[peft_type] = config_cls
    mapping.PEFT_TYPE_TO_TUNER_MAPPING[peft_type] = model_cls
    if is_mixed_compatible:
        mapping.PEFT_TYPE_TO_MIXED_MODEL_MAPPING[peft_type] = model_cls


def unregister_method(peft_type: str) -> None:
    """Remove `peft_type` from every table (used when a reloaded module registers its re-created classes)."""
    from peft import mapping

    for table in MAPPING_TABLES:
        getattr(mapping, table).pop(peft_type, None)


def registered_config(peft_type: str) -> type | None:
    """The config class peft maps `peft_type` to, if any."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    return PEFT_TYPE_TO_CONFIG_MAPPING.get(peft_type)


def registered_prefixes() -> dict[str, str]:
    """Every registered method's parameter prefix, by type."""
    from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING

    return dict(PEFT_TYPE_TO_PREFIX_MAPPING)
