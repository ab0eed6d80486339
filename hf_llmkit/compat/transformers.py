"""transformers internals hf_llmkit relies on (checked against transformers 5.23.0), in three groups.

**The Trainer.** `LLMKitTrainer` overrides five private `Trainer` methods; each is needed because no public hook runs
at that point:

- `_save_checkpoint(model, trial)`: the only place that runs before a checkpoint's first byte and after its last.
  hf_llmkit marks the folder as being written, holds off the Trainer's own `save_total_limit` rotation (which runs
  at the end of this method, before the checkpoint is complete, and counts incomplete folders), retries transient
  I/O errors on every rank together, turns disk-full / permission errors into one line, and writes the run record.
- `_load_from_checkpoint(resume_from_checkpoint, model=None)`: resume loads exactly the adapters a PEFT model has
  (the Trainer loads every adapter subfolder as one more adapter) and the hub-layout experts of MoE models.
- `_load_best_model()`: the best checkpoint is verified before it is loaded, and MoE experts are converted.
- `_clip_grad_norm(model)`: under expert parallelism (DDP) the clipping norm covers the experts of every rank.
- `_save(output_dir, state_dict)`: the full state dict `save_model` gathered on every rank (FSDP2, ZeRO-3) reaches
  the main process's write only here; a DKM model packs its indices from it (`save_pretrained` asks the quantizer
  for the state dict to write and does not pass on the one it was given).

Expert parallelism also calls `Trainer._save(output_dir, state_dict)` to write the gathered full model the way a
normal save would (safetensors, config, tokenizer, training arguments). It also relies on `_save_checkpoint`
reading `args.save_total_limit` for its rotation (held off as above), and on `save_model(output_dir,
_internal_call)`, whose private flag tells a checkpoint's model save from a final one. (`benchmarks/callbacks.py`
and the checkpoint tests call `_save_checkpoint` / `_load_best_model` directly to time or drive exactly that step.)

**The attention stack.** transformers lets a plugin register attention functions (`AttentionInterface.register`)
and mask builders (`AttentionMaskInterface.register`) and switch a model to one
(`PreTrainedModel.set_attn_implementation`), but it has no public way to *read* which implementation a model
uses, and a few of its own kernels read that private attribute from the module they are handed:

- `config._attn_implementation`: the implementation the model dispatches to (`configured_attention`);
- flash-attention kernels read `module.config._attn_implementation` to pick the flash library, so a wrapper that
  hands them a module must report the kernel's own name there (`ConfigReportingKernel`);
- "eager" is not in `ALL_ATTENTION_FUNCTIONS`: each modeling file defines its own `eager_attention_forward`
  (`model_eager_attention`).

**The DKM quantizer.** `HfQuantizer`'s documented extension points are underscore methods
(`_process_model_before_weight_loading`, `_process_model_after_weight_loading`: "make sure to override" them, its
docstrings say); `from_pretrained` hands the first one `checkpoint_files`, which the DKM loader reads. Besides:

- `PreTrainedModel._keep_in_fp32_modules`: the modules a model wants kept in float32. transformers' own quantizers
  (bitsandbytes, torchao) read it the same way to build their skip lists; there is no public accessor.
- `PreTrainedModel._keys_to_ignore_on_load_unexpected`: the documented way for a model to silence "unexpected key"
  reports on load. A DKM Trainer checkpoint holds two representations of each clustered layer (the training state
  and the packed export); the representation the loaded layer does not use is expected, not unexpected.

- `PreTrainedModel.all_tied_weights_keys`: the `{target: source}` parameters a load ties (`tie_weights` reads it).
  A tied LM head over a clustered embedding has no dense weight to share (hf_llmkit.quantization.tied): its entry
  is dropped (`untie`), which `tie_weights(recompute_mapping=False)`, the call `from_pretrained` makes, honours.

- `_is_hf_initialized` / `PreTrainedModel._init_weights`: `from_pretrained` flags every tensor it loads with
  `_is_hf_initialized` and initialises the rest with the model's `_init_weights`, which knows `nn.Linear` only: a
  packed DKM layer's bias that the checkpoint lacks (`attention_bias=True`, another architecture's class) would be
  left as uninitialised memory. `initialise_missing_bias` gives it what `_init_weights` gives a Linear's bias.

- `transformers.core_model_loading.ConversionOps`: the base class of a weight-loading operation, which
  `get_quantize_ops` must return (`DKMInitTables`); the module is not part of the documented API.
- `transformers.quantizers.quantizers_utils.get_module_from_name` / `should_convert_module`: the helpers every
  built-in quantizer uses to find a parameter's module and to apply `modules_to_not_convert` patterns the same way.
- `transformers.quantizers.auto.AUTO_QUANTIZATION_CONFIG_MAPPING` / `AUTO_QUANTIZER_MAPPING`: the registries
  `register_quantization_config` / `register_quantizer` fill; reading them is the only way to know whether "dkm" is
  registered already (registering twice raises), so importing hf_llmkit twice stays a no-op.

**Callback states in a checkpoint.** The Trainer saves each `ExportableState` callback's `state()` under
`TrainerState.stateful_callbacks[<class name>]` and, on save, indexes that dict by name: resumed from a checkpoint
saved without one of them, the save fails with a KeyError (transformers 5.23). `saved_callback_state` gives a
callback its entry (the saved attributes on resume); `add_saved_callback_states` writes entries into a
`trainer_state.json` dict as the Trainer would (the fault-tolerance rollback copy).

**Renamed keywords.** transformers 5.24 renames the KV-cache keyword of every model's forward from
`past_key_values` to `cache` (the old name is deprecated until 5.40). `cache_keyword(model)` is the name the
installed transformers takes, so code and tests that pass a cache work on both sides of the rename.

**Router logits.** `output_router_logits=True` (and TRL's `SFTTrainer`, which turns it on for every model whose
config has `router_aux_loss_coef`) collects each MoE layer's router logits through forward hooks that transformers
installs on the modules of its own router classes (`_can_record_outputs`); an `MoELayer` router inside a Mixtral /
Qwen2-MoE model is not of those classes, so nothing was collected and the load-balancing loss failed on an empty
tuple. `record_router_logits` installs the same hook (`utils.output_capturing.install_output_capuring_hook`, inactive
unless a forward asks for router logits) on our router.

**MoE experts.** transformers' experts modules dispatch through its `ExpertsInterface` registry, which a plugin
fills with `ExpertsInterface.register` (public). `experts_implementation="llmkit"` computes one layout only: the
instance flags the `use_experts_implementation` decorator sets and the private gating hook `_apply_gate` (default
`integrations.moe._default_apply_gate`) say whether a model's experts have it (`experts_layout_problem`). The
routers of Mixtral / Qwen2-MoE return `(router_logits, router_scores, router_indices)`; a forward hook reads the
logits and chosen experts from it for the MoE losses (`router_logits_and_experts`).

`tests/compat/test_transformers*.py` fail when any of these is gone or changed its parameters.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from transformers.core_model_loading import ConversionOps
from transformers.quantizers.quantizers_utils import get_module_from_name, should_convert_module

CHECKED_AGAINST = "5.23.0"

# Private Trainer methods LLMKitTrainer overrides -> the parameters (after self) it relies on.
TRAINER_PRIVATE_HOOKS: dict[str, tuple[str, ...]] = {
    "_save_checkpoint": ("model", "trial"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_best_model": (),
    "_clip_grad_norm": ("model",),
    "_save": ("output_dir", "state_dict"),
}
# Private Trainer methods hf_llmkit calls -> the parameters it passes.
TRAINER_PRIVATE_CALLS: dict[str, tuple[str, ...]] = {"_save": ("output_dir", "state_dict")}
# Public Trainer methods whose private parameters LLMKitTrainer reads.
TRAINER_PRIVATE_PARAMETERS: dict[str, tuple[str, ...]] = {"save_model": ("output_dir", "_internal_call")}
# HfQuantizer hooks DKMHfQuantizer overrides -> the public method that calls each.
QUANTIZER_HOOKS: dict[str, str] = {
    "_process_model_before_weight_loading": "preprocess_model",
    "_process_model_after_weight_loading": "postprocess_model",
}

__all__ = [
    "CHECKED_AGAINST",
    "QUANTIZER_HOOKS",
    "TRAINER_PRIVATE_CALLS",
    "TRAINER_PRIVATE_HOOKS",
    "TRAINER_PRIVATE_PARAMETERS",
    "ConfigReportingKernel",
    "ConversionOps",
    "add_saved_callback_states",
    "cache_keyword",
    "configured_attention",
    "get_module_from_name",
    "ignore_unexpected_keys",
    "initialise_missing_bias",
    "keep_in_fp32_modules",
    "loaded_by_from_pretrained",
    "missing_quantizer_internals",
    "missing_trainer_internals",
    "model_eager_attention",
    "quantization_method_registered",
    "experts_layout_problem",
    "record_router_logits",
    "router_logits_and_experts",
    "saved_callback_state",
    "should_convert_module",
    "tied_parameters",
    "untie",
]


def missing_trainer_internals() -> list[str]:
    """What the installed `transformers.Trainer` lacks of the above (empty when everything is there)."""
    from transformers import Trainer

    missing = []
    for table in (TRAINER_PRIVATE_HOOKS, TRAINER_PRIVATE_CALLS, TRAINER_PRIVATE_PARAMETERS):
        for name, expected in table.items():
            method = getattr(Trainer, name, None)
            if method is None:
                missing.append(f"Trainer.{name}")
                continue
            parameters = tuple(inspect.signature(method).parameters)[1:]
            if parameters[: len(expected)] != expected:
                missing.append(f"Trainer.{name}{expected} (found {parameters})")
    if "save_total_limit" not in inspect.getsource(Trainer._save_checkpoint):
        missing.append("Trainer._save_checkpoint no longer rotates by args.save_total_limit")
    return missing


def missing_quantizer_internals() -> list[str]:
    """What the installed `HfQuantizer` / `from_pretrained` lack of `QUANTIZER_HOOKS` (empty when all is there)."""
    from transformers import PreTrainedModel
    from transformers.quantizers.base import HfQuantizer

    missing = []
    for hook, caller in QUANTIZER_HOOKS.items():
        if not hasattr(HfQuantizer, hook):
            missing.append(f"HfQuantizer.{hook}")
        elif f"self.{hook}(" not in inspect.getsource(getattr(HfQuantizer, caller)):
            missing.append(f"HfQuantizer.{caller} no longer calls {hook}")
    if "checkpoint_files=checkpoint_files" not in inspect.getsource(PreTrainedModel.from_pretrained):
        missing.append("from_pretrained no longer passes checkpoint_files to the quantizer")
    from transformers import core_model_loading

    if "_is_hf_initialized = True" not in inspect.getsource(core_model_loading):
        missing.append("from_pretrained no longer flags loaded tensors with _is_hf_initialized")
    if not callable(getattr(PreTrainedModel, "_init_weights", None)):
        missing.append("PreTrainedModel._init_weights")
    return missing


# --- the attention stack ---------------------------------------------------------------------------------------


def configured_attention(config: Any) -> str | None:
    """The attention implementation name a model with this config dispatches to (`None` before it was resolved)."""
    return config._attn_implementation


class ConfigReportingKernel:
    """A model config whose `_attn_implementation` reports `kernel` (what a flash kernel reads to pick its library)."""

    def __init__(self, config: Any, kernel: str) -> None:
        self._config, self._attn_implementation = config, kernel

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def model_eager_attention(module: Any) -> Callable[..., Any] | None:
    """The `eager_attention_forward` of the modeling file that defines `module`'s class, or None."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


# --- the DKM quantizer ------------------------------------------------------------------------------------------


def keep_in_fp32_modules(model) -> list[str]:
    """Module names the model keeps in float32 (never clustered)."""
    return sorted(getattr(model, "_keep_in_fp32_modules", None) or [])


def ignore_unexpected_keys(model, patterns: list[str]) -> None:
    """Add regex `patterns` to the keys a load of `model` does not report as unexpected."""
    current = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    model._keys_to_ignore_on_load_unexpected = current | set(patterns)


def tied_parameters(model) -> dict[str, str]:
    """`{target parameter: source parameter}` of the ties the model makes (a copy)."""
    return dict(getattr(model, "all_tied_weights_keys", None) or {})


def untie(model, target: str) -> None:
    """Drop the tie of parameter `target` from what the model's next `tie_weights(recompute_mapping=False)` ties."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied:
        tied.pop(target, None)


def loaded_by_from_pretrained(tensor: Any) -> bool:
    """Whether `from_pretrained` filled `tensor` from the checkpoint (or initialised it already)."""
    return bool(getattr(tensor, "_is_hf_initialized", False))


def initialise_missing_bias(model: Any, bias: Any) -> None:
    """Initialise `bias`, a Linear-like layer's bias the checkpoint did not hold, as `from_pretrained` initialises a
    missing `nn.Linear` bias: through the model's own `_init_weights` (zeros, in every transformers model), handed a
    stand-in `nn.Linear` that holds `bias` (its own weight marked as initialised, so left alone)."""
    import torch

    stand_in = torch.nn.Linear(1, 1, bias=False)
    stand_in.weight._is_hf_initialized = True
    stand_in.bias = bias
    init = getattr(model, "_init_weights", None)
    with torch.no_grad():
        if callable(init):
            init(stand_in)
        else:
            bias.zero_()
    bias._is_hf_initialized = True


def quantization_method_registered(name: str) -> tuple[bool, bool]:
    """Whether `name` is registered with transformers as (a quantization config, a quantizer)."""
    from transformers.quantizers import auto

    return name in auto.AUTO_QUANTIZATION_CONFIG_MAPPING, name in auto.AUTO_QUANTIZER_MAPPING


# --- callback states in a checkpoint ------------------------------------------------------------------------------


def saved_callback_state(state: Any, name: str, default: Any) -> Any:
    """The entry `name` of `state.stateful_callbacks` (what a checkpoint saved for that callback), set to `default`
    first when the checkpoint had none (else the Trainer's next save fails on the missing key)."""
    return state.stateful_callbacks.setdefault(name, default)


def add_saved_callback_states(saved_state: dict[str, Any], states: dict[str, Any]) -> None:
    """Write `states` (callback class name -> `state()`) into a `trainer_state.json` dict as the Trainer saves them."""
    saved_state.setdefault("stateful_callbacks", {}).update(states)


def cache_keyword(model: Any) -> str:
    """The keyword `model`'s forward takes its KV cache by: `"cache"` from transformers 5.24, else
    `"past_key_values"`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# --- router logits -----------------------------------------------------------------------------------------------


def _router_hook_installer() -> Callable[..., Any] | None:
    from transformers.utils import output_capturing

    return getattr(output_capturing, "install_output_capuring_hook", None)


def record_router_logits(router: Any) -> bool:
    """Let transformers collect `router`'s logits (the first element of its output) as `router_logits`, like its
    own router modules' (so `output_router_logits=True` and its load-balancing loss see them). False when the
    installed transformers has no such hook (`tests/compat/test_transformers_router_logits.py` fails then)."""
    install = _router_hook_installer()
    if install is None:
        return False
    install(router, "router_logits", 0)
    return True


# --- MoE experts: the ExpertsInterface registry ------------------------------------------------------------------


def experts_layout_problem(experts: Any) -> str | None:
    """Why `experts` (a class decorated with transformers' `use_experts_implementation`) is not SwiGLU experts with
    concatenated `[gate | up]` weights `[E, 2I, H]`, `down [E, H, I]`, no biases and the default gating -- the layout
    `experts_implementation="llmkit"` computes -- or None. The decorator sets the layout flags on each instance;
    `_apply_gate` is the gating hook an experts class may override (`_default_apply_gate` otherwise)."""
    import transformers.integrations.moe as moe

    if not getattr(experts, "has_gate", False):
        return "has no gate projection"
    if getattr(experts, "has_bias", False):
        return "has biases"
    if getattr(experts, "is_transposed", False):
        return "stores its weights transposed"
    if not getattr(experts, "is_concatenated", True):
        return "interleaves its gate and up rows"
    if getattr(experts, "has_post_expert_norm", False):
        return "normalises each expert's output"
    if getattr(type(experts), "_apply_gate", moe._default_apply_gate) is not moe._default_apply_gate:
        return "has its own gating function"
    return None


def router_logits_and_experts(output: Any) -> tuple[Any, Any]:
    """The router logits `[T, E]` and chosen experts `[T, K]` from the output of a Mixtral / Qwen2-MoE router
    (`MixtralTopKRouter` / `Qwen2MoeTopKRouter` return `(router_logits, router_scores, router_indices)`)."""
    logits, _scores, experts = output
    return logits, experts
