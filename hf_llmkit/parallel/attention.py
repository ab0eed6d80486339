"""One attention stack for every hf_llmkit feature that wraps a model's attention.

Features that change how attention is computed are *layers* around the model's kernel (sdpa, eager, flash
attention). Each layer has a fixed place in the stack, outermost first:

    Ulysses sequence parallelism    all-to-all: this rank's sequence shard, all heads -> full sequence, H/P heads
      P-tuning v2 prefixes          prefix keys/values prepended on the heads this rank holds
        the kernel                  the implementation the model used before any layer was added

so adding (or removing) layers in any order gives the same computation: with both, the prefixes join the
full-sequence attention on each rank's head slice. A layer is added with `add_attention_layer(model, layer)` and
removed with `remove_attention_layer(model, kind)`. Each combination is registered once with transformers' public
attention API (`AttentionInterface.register` for the function, `AttentionMaskInterface.register` for the mask
builder the model's mask code calls) under a name spelled from its layers, e.g. `"ptuning_v2_sdpa"` or
`"llmkit_ulysses_ptuning_v2_sdpa@7f3a"`, and installed with `model.set_attn_implementation(name)`. Flash kernels
are spelled `fa2`/`fa3`/`fa4` in those names: `set_attn_implementation` tries to load a flash library for any name
that contains "flash"; the kernel itself is still told its real name.

Kernels and mask builders are looked up as registered with transformers (`AttentionInterface()`,
`AttentionMaskInterface()`), not through process-local overrides of the shared `ALL_ATTENTION_FUNCTIONS` instance:
DeepSpeed's Ulysses, for one, replaces `"sdpa"` there for the whole process, and a stack must not run it inside.

Tensors a layer hands to the layers inside it through keyword arguments and that hold one slice per key/value head
(the P-tuning v2 prefix) are declared with `register_head_sharded_kwarg`, so a layer that splits the heads over
ranks (Ulysses) splits them too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from hf_llmkit.compat.transformers import ConfigReportingKernel, configured_attention, model_eager_attention

AttentionCall = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
# Names only: set_attn_implementation loads a flash library for any implementation name containing "flash".
_KERNEL_ALIASES = {"flash_attention_2": "fa2", "flash_attention_3": "fa3", "flash_attention_4": "fa4"}
_HEAD_SHARDED_KWARGS: dict[str, int] = {}


def register_head_sharded_kwarg(name: str, *, dim: int) -> None:
    """Declare that keyword argument `name` carries a tensor with one slice per key/value head along `dim`."""
    _HEAD_SHARDED_KWARGS[name] = dim


def head_sharded_kwargs() -> dict[str, int]:
    """Keyword arguments declared with `register_head_sharded_kwarg`: name -> key/value-head dimension."""
    return dict(_HEAD_SHARDED_KWARGS)


class ModuleView:
    """An attention module as a layer hands it inward, with some attributes replaced (e.g. on a head shard)."""

    def __init__(self, module: Any, **overrides: Any) -> None:
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class AttentionLayer:
    """One wrapper of the stack. Subclasses set `kind` (one layer per kind), `order` (smaller = further out) and
    `name_prefix`, and implement `__call__`, which calls `inner(module, query, key, value, mask, **kwargs)` for the
    rest of the stack."""

    kind: ClassVar[str]
    order: ClassVar[int]
    name_prefix: ClassVar[str]

    def name_suffix(self) -> str:
        """Appended to the stack's name; distinguishes layers of one kind with different state (e.g. groups)."""
        return ""

    def check_kernel(self, kernel: str) -> None:
        """Raise `ValueError` when this layer cannot wrap `kernel`."""

    def mask_function(self, kernel: str) -> Callable[..., Any] | None:
        """The mask builder the model's mask code must call when this is the outermost layer (None: the next's)."""
        return None

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        inner: AttentionCall,
        kernel: str,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name_suffix()!r})"


def kernel_function(kernel: str, module: nn.Module) -> AttentionCall:
    """The function of a kernel name for `module` (eager lives in the module's own modeling file)."""
    if kernel == "eager":
        fn = model_eager_attention(module)
        if fn is None:
            raise ValueError(
                f"{type(module).__name__} has no module-level eager_attention_forward to wrap; load the model with "
                "attn_implementation='sdpa'"
            )
        return fn
    registered = AttentionInterface()  # the registered functions, without process-local overrides
    if kernel not in registered:
        raise ValueError(f"attention implementation {kernel!r} is not registered with transformers")
    return registered[kernel]


def kernel_mask_function(kernel: str) -> Callable[..., Any] | None:
    """The mask builder transformers registered for a kernel (None when it has none)."""
    return AttentionMaskInterface().get(kernel)


def _call_kernel(kernel: str, fn: AttentionCall, module: Any, *args: Any, **kwargs: Any):
    if kernel.startswith("flash"):  # the kernel picks its library from module.config
        module = ModuleView(module, config=ConfigReportingKernel(module.config, kernel))
    return fn(module, *args, **kwargs)


@dataclass(frozen=True)
class AttentionStack:
    """The kernel and the layers around it, outermost first."""

    kernel: str
    layers: tuple[AttentionLayer, ...] = ()

    @property
    def name(self) -> str:
        """The implementation name this stack is registered under (the kernel's own name when there is no layer)."""
        if not self.layers:
            return self.kernel
        prefix = "".join(layer.name_prefix for layer in self.layers)
        suffix = "".join(layer.name_suffix() for layer in self.layers)
        return prefix + _KERNEL_ALIASES.get(self.kernel, self.kernel) + suffix

    def find(self, kind: str) -> AttentionLayer | None:
        return next((layer for layer in self.layers if layer.kind == kind), None)

    def with_layer(self, layer: AttentionLayer) -> AttentionStack:
        """This stack with `layer` in its place (replacing a layer of the same kind)."""
        layer.check_kernel(self.kernel)
        others = [other for other in self.layers if other.kind != layer.kind]
        return AttentionStack(self.kernel, tuple(sorted([*others, layer], key=lambda item: item.order)))

    def without(self, kind: str) -> AttentionStack:
        return AttentionStack(self.kernel, tuple(layer for layer in self.layers if layer.kind != kind))

    def mask_function(self) -> Callable[..., Any] | None:
        for layer in self.layers:
            fn = layer.mask_function(self.kernel)
            if fn is not None:
                return fn
        return kernel_mask_function(self.kernel)


class StackedAttention:
    """The function registered for one stack: calls the layers outermost first, then the kernel."""

    def __init__(self, stack: AttentionStack) -> None:
        self.stack = stack

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,  # [B, H, S, D]
        key: torch.Tensor,  # [B, KVH, S, D]
        value: torch.Tensor,  # [B, KVH, S, D]
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        kernel = self.stack.kernel
        call: AttentionCall = partial(_call_kernel, kernel, kernel_function(kernel, module))
        for layer in reversed(self.stack.layers):
            call = partial(layer, inner=call, kernel=kernel)
        return call(module, query, key, value, attention_mask, **kwargs)

    def __repr__(self) -> str:
        return f"StackedAttention({self.stack.name!r})"


def stack_named(name: str | None) -> AttentionStack:
    """The stack an implementation name stands for (a plain kernel when it is not one of ours)."""
    name = name or "eager"
    registered = AttentionInterface().get(name)
    if isinstance(registered, StackedAttention):
        return registered.stack
    return AttentionStack(kernel=name)


def stack_of(config: Any) -> AttentionStack:
    """The attention stack a model with this config runs."""
    return stack_named(configured_attention(config))


def register_stack(stack: AttentionStack) -> str:
    """Register `stack`'s function and mask builder with transformers (again, if already there); returns its name."""
    name = stack.name
    if stack.layers:
        AttentionInterface.register(name, StackedAttention(stack))
        mask = stack.mask_function()
        if mask is not None:
            AttentionMaskInterface.register(name, mask)
    return name


def _pretrained_models(model: nn.Module) -> list[nn.Module]:
    """The transformers models inside `model` (peft / DDP / DeepSpeed wrappers included), one per config,
    outermost first."""
    from transformers import PreTrainedModel

    found: dict[int, nn.Module] = {}
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel):
            found.setdefault(id(sub.config), sub)
    if not found:
        raise TypeError(f"attention layers wrap transformers PreTrainedModels, got {type(model).__name__}")
    return list(found.values())


def _restack(model: nn.Module, change: Callable[[AttentionStack], AttentionStack]) -> nn.Module:
    targets = [(sub, change(stack_of(sub.config))) for sub in _pretrained_models(model)]  # all checks first
    for sub, stack in targets:
        name = register_stack(stack)
        sub.set_attn_implementation(name)
        if configured_attention(sub.config) != name:
            raise ValueError(
                f"{type(sub).__name__} does not dispatch attention through transformers' AttentionInterface, so "
                f"{', '.join(type(layer).__name__ for layer in stack.layers) or 'hf_llmkit'} cannot wrap it"
            )
    return model


def add_attention_layer(model: nn.Module, layer: AttentionLayer) -> nn.Module:
    """Put `layer` in its place in the attention stack of every transformers model in `model`; returns `model`.

    A layer of the same kind is replaced. Raises `ValueError` when the layer cannot wrap the model's kernel.
    """
    return _restack(model, lambda stack: stack.with_layer(layer))


def remove_attention_layer(model: nn.Module, kind: str) -> nn.Module:
    """Take the layer of `kind` out of `model`'s attention stacks (a no-op where there is none); returns `model`."""
    return _restack(model, lambda stack: stack.without(kind))


def attention_layer(model_or_config: Any, kind: str) -> AttentionLayer | None:
    """The layer of `kind` in the attention stack of `model_or_config` (a model or a model config), or None."""
    if isinstance(model_or_config, nn.Module):
        for sub in _pretrained_models(model_or_config):
            layer = stack_of(sub.config).find(kind)
            if layer is not None:
                return layer
        return None
    return stack_of(model_or_config).find(kind)
