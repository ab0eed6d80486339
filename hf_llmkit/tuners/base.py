"""The peft plumbing every hf_llmkit method shares (bottleneck, BitFit, P-tuning v1/v2).

- `LLMKitTuner` (a peft `BaseTuner`): each method names its layer class (`tuner_layer_cls`, built as
  `cls(target, adapter_name, config, key=name)`); this class checks the targets before injection (difflib hints),
  wraps each target once (a second adapter updates the existing layer), refuses another method's layer, puts whole
  blocks back on `unload()`, gives whole-module adapter state the right checkpoint keys, and refuses every merge when
  the layer class declares a `merge_error`.
- `UnmergeableLayer`: `merge()` raises the layer's `merge_error`; nothing is ever merged, so `unmerge()` does nothing.
- `SavedModulesConfig`: peft's `modules_to_save` and `ensure_weight_tying`, on every config;
  `LayerSelectionConfig` adds peft's module-selection fields (`exclude_modules`, `layers_to_transform`,
  `layers_pattern`), normalised and checked as peft's own configs do.

`modules_to_save` is peft's own machinery (`ModulesToSaveWrapper`, applied after injection); this class only has to
treat its wrappers as what they are when it unloads or walks modules: a wrapper whose active copy is a plain module,
not a tuner layer (`hf_llmkit.tuners.matching.visible_modules`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from peft.config import PeftConfig
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import AuxiliaryTrainingWrapper
from torch import nn

from hf_llmkit.tuners.matching import check_targets_exist, unwrapped, visible_modules


@dataclass
class SavedModulesConfig(PeftConfig):
    """peft's `modules_to_save` and `ensure_weight_tying`, with LoRA's meaning.

    Args:
        modules_to_save (`list[str]`, *optional*):
            Extra modules trained in full and saved with the adapter (e.g. a classifier head, or the seed recipe's
            `["embed_tokens", "lm_head"]`).
        ensure_weight_tying (`bool`):
            With a model that ties its input and output embeddings and both listed in `modules_to_save`: train one
            copy of them, still tied (as LoRA's option of the same name). False: two independent copies, as peft
            does by default (it warns).
    """

    modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Extra modules trained in full and saved with the adapter."}
    )
    ensure_weight_tying: bool = field(
        default=False,
        metadata={"help": "Keep tied input/output embeddings listed in modules_to_save tied (one trained copy)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.modules_to_tie = None  # set by the tuner when ensure_weight_tying ties copies (peft reads it)


@dataclass
class LayerSelectionConfig(SavedModulesConfig):
    """Which modules a layer tuner adapts besides `target_modules` (declared by each method with its own default).

    Args:
        exclude_modules (`list[str]` or `str`, *optional*):
            Modules never adapted, same matching rules as `target_modules`.
        layers_to_transform (`list[int]` or `int`, *optional*):
            Only adapt these layer indices.
        layers_pattern (`list[str]` or `str`, *optional*):
            Name of the layer list used with `layers_to_transform` (e.g. "layers", "h").

    `modules_to_save` and `ensure_weight_tying` as in `SavedModulesConfig`.
    """

    exclude_modules: Union[list[str], str] | None = field(
        default=None, metadata={"help": "Modules never adapted (regex or list of name suffixes)."}
    )
    layers_to_transform: Union[list[int], int] | None = field(
        default=None, metadata={"help": "Only adapt these layer indices."}
    )
    layers_pattern: Union[list[str], str] | None = field(
        default=None, metadata={"help": "Layer list name used with layers_to_transform (e.g. 'layers')."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(getattr(self, "target_modules", None), list):
            self.target_modules = set(self.target_modules)
        if isinstance(self.exclude_modules, list):
            self.exclude_modules = set(self.exclude_modules)
        if self.layers_pattern and self.layers_to_transform is None:
            raise ValueError("layers_pattern only applies with layers_to_transform; set layers_to_transform too.")


class UnmergeableLayer:
    """Mixin of tuner layers whose adapter is no linear map of a base weight (so there is nothing to fold)."""

    merge_error: ClassVar[str]  # the ValueError message: why, and what to use instead (`unload()`)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise ValueError(self.merge_error)

    def unmerge(self) -> None:
        """Nothing is ever merged (see `merge`)."""


PACKED_FIX = "call hf_llmkit.quantization.trainable_from_packed(model) first (the same weights, in layers it adapts)"


def refuse_packed_layers(model: nn.Module, method: str) -> None:
    """A compact DKM checkpoint's packed layers (no dense weight, nothing to wrap) are refused in one line naming
    `trainable_from_packed`."""
    from hf_llmkit.quantization.integration import PACKED

    packed = next((name for name, m in model.named_modules() if isinstance(m, PACKED)), None)
    if packed is not None:
        kind = type(model.get_submodule(packed)).__name__
        raise ValueError(
            f"{method} cannot adapt a compact DKM checkpoint's packed layers ({packed!r} is a {kind}); {PACKED_FIX}"
        )


class LLMKitTuner(BaseTuner):
    target_module_mapping: ClassVar[dict] = {}  # defaults are computed from the model in _prepare_adapter_config
    adapts_packed_layers: ClassVar[bool] = False  # whether it works on a compact DKM checkpoint's packed layers

    def _prepare_model(self, peft_config: Any, model: nn.Module) -> None:
        if not self.adapts_packed_layers:
            refuse_packed_layers(model, type(peft_config).__name__)
        # Modules that an earlier adapter's `modules_to_save` wraps (the wrapper, its original, its plain copies)
        # are never targets: peft matches names over every module, and would adapt the copies of another adapter.
        self._saved_module_names = [n for n, m in model.named_modules() if isinstance(m, AuxiliaryTrainingWrapper)]
        check_targets_exist(model, peft_config.target_modules, type(peft_config).__name__)

    def _check_target_module_exists(self, peft_config: Any, key: str) -> Any:
        if any(key == n or key.startswith(n + ".") for n in getattr(self, "_saved_module_names", ())):
            return False
        return super()._check_target_module_exists(peft_config, key)

    def _create_and_replace(
        self,
        peft_config: Any,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        **optional_kwargs: Any,
    ) -> None:
        if isinstance(target, self.tuner_layer_cls):
            target.update_layer(adapter_name, peft_config, key=current_key)
            return
        if isinstance(target, BaseTunerLayer):
            raise ValueError(
                f"{current_key} is already wrapped by another PEFT method; apply {type(peft_config).__name__} first"
            )
        new_module = self.tuner_layer_cls(target, adapter_name, peft_config, key=current_key)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)  # an added, inactive adapter is not trainable
        self._replace_module(parent, target_name, new_module, target)

    def _check_merge_allowed(self) -> None:
        if issubclass(self.tuner_layer_cls, UnmergeableLayer):
            raise ValueError(self.tuner_layer_cls.merge_error)
        super()._check_merge_allowed()

    def _replace_module(self, parent: nn.Module, child_name: str, new_module: nn.Module, child: nn.Module) -> None:
        # peft's version copies `child.weight` onto the module it puts back when unloading. There is nothing to copy
        # when `child` is a `modules_to_save` wrapper (the module coming back is its active copy, a plain module with
        # its own weights, or its original) or a tuner layer around a whole block (an MLP, an attention module).
        unloading = not hasattr(new_module, "base_layer")
        if unloading and (isinstance(child, AuxiliaryTrainingWrapper) or not hasattr(unwrapped(child), "weight")):
            setattr(parent, child_name, new_module)
            return
        super()._replace_module(parent, child_name, new_module, child)

    def _add_modules_to_save_to_tie(self, peft_config: Any, tied_weight_keys: list[str]) -> None:
        # `ensure_weight_tying` with the tied embeddings in `modules_to_save`: the input embedding gets the trained
        # copy and every module tied to it (`lm_head`) is wrapped by peft around that same copy (`modules_to_tie`).
        embeddings = self.model.get_input_embeddings()
        name = next(n for n, m in visible_modules(self.model) if m is embeddings)
        tied = set(tied_weight_keys)
        kept = [m for m in peft_config.modules_to_save or [] if not any(_names_module(m, key) for key in tied)]
        if not any(_names_module(m, name) for m in kept):
            kept.append(name)
        peft_config.modules_to_save = kept
        peft_config.modules_to_tie = tied

    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        # `<attr>.<adapter>.head.0.weight` -> `<attr>.head.0.weight` for adapter state held as whole modules (a
        # ModuleDict of encoders); peft's default only strips `<attr>.<adapter>` followed by a single suffix.
        for attr in cls.tuner_layer_cls.adapter_layer_names:
            marker = f".{attr}.{adapter_name}."
            if marker in key:
                return key.replace(marker, f".{attr}.", 1)
        return super()._remove_adapter_name_from_key(key, adapter_name)


def _names_module(entry: str, key: str) -> bool:
    """Whether a `modules_to_save` entry names the module `key` (peft's rule: a dotted suffix of the name)."""
    return re.match(rf"(^|.*\.){re.escape(entry)}$", key) is not None
