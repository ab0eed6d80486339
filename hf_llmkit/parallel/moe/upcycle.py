"""Sparse upcycling (Komatsuzaki et al., 2022): a dense Llama / Mistral / Qwen2 model becomes an MoE model.

`upcycle_to_moe` returns the model as transformers' own MoE architecture (Mixtral for Llama and Mistral,
Qwen2-MoE for Qwen2), every expert a copy of the dense MLP, in transformers' own sparse blocks computing through
`experts_implementation="llmkit"` (or `MoELayer`s, with a capacity limit). Attention,
norms and embeddings are the dense model's tensors (moved, not copied). Because the config, the class
and every state-dict key are the native ones, `save_pretrained` writes a checkpoint plain transformers
loads as that MoE architecture, and `from_pretrained` of it needs no hf_llmkit. `use_moe_layers` goes the
other way: it swaps the native sparse blocks of a loaded Mixtral / Qwen2-MoE model for `MoELayer`s
(for capacity limits or hf_llmkit's expert parallelism; our expert compute needs no swap).

Example:
    ```python
    from hf_llmkit.parallel import upcycle_to_moe

    moe_model = upcycle_to_moe(dense_model, num_experts=8, top_k=2)  # a MixtralForCausalLM
    moe_model.save_pretrained("out")  # AutoModelForCausalLM.from_pretrained("out") -> Mixtral
    ```
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import transformers
from torch import nn

from hf_llmkit.compat.transformers import configured_attention
from hf_llmkit.parallel.moe.layer import MoELayer
from hf_llmkit.parallel.moe.registry import register_experts_implementation


@dataclass(frozen=True)
class _Target:
    """How one dense architecture maps onto its native MoE counterpart."""

    class_prefix: str  # dense class name prefix, e.g. "Llama" (LlamaForCausalLM -> MixtralForCausalLM)
    moe_prefix: str
    config_class: str
    expert_count_key: str  # the MoE config's name for the number of experts
    carried: tuple[str, ...]  # dense config fields that mean the same in the MoE config


_COMMON = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters",
    "attention_dropout",
)  # fmt: skip
_SUPPORTED = {
    "llama": _Target("Llama", "Mixtral", "MixtralConfig", "num_local_experts", (*_COMMON, "head_dim")),
    "mistral": _Target(
        "Mistral", "Mixtral", "MixtralConfig", "num_local_experts", (*_COMMON, "head_dim", "sliding_window")
    ),
    "qwen2": _Target(
        "Qwen2", "Qwen2Moe", "Qwen2MoeConfig", "num_experts",
        (*_COMMON, "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
    ),
}  # fmt: skip


def is_native_moe_block(module: nn.Module) -> bool:
    """Whether `module` is a sparse block of transformers' Mixtral or Qwen2-MoE (what `use_moe_layers` replaces)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    return isinstance(module, (MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock))


def supported_architectures() -> list[str]:
    """`model_type`s `upcycle_to_moe` accepts."""
    return sorted(_SUPPORTED)


def _target_for(model: nn.Module) -> tuple[_Target, type]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _SUPPORTED:
        raise ValueError(
            f"upcycle_to_moe does not support model_type={model_type!r}; supported architectures: "
            f"{', '.join(supported_architectures())} (Llama and Mistral become Mixtral, Qwen2 becomes Qwen2-MoE)"
        )
    target = _SUPPORTED[model_type]
    name = type(model).__name__
    moe_name = target.moe_prefix + name[len(target.class_prefix) :] if name.startswith(target.class_prefix) else None
    moe_cls = getattr(transformers, moe_name, None) if moe_name else None
    if moe_cls is None:
        raise ValueError(f"{name} has no {target.moe_prefix} counterpart in transformers; upcycle its *ForCausalLM")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError(
            f"{target.moe_prefix} has no attention or MLP biases: upcycle a {target.class_prefix} model with "
            "attention_bias=False and mlp_bias=False"
        )
    return target, moe_cls


def _moe_config(
    config, target: _Target, *, num_experts: int, top_k: int, jitter_noise: float, shared: int, experts: str | None
):
    values = {key: getattr(config, key) for key in target.carried if hasattr(config, key)}
    if experts is not None:
        values["experts_implementation"] = experts  # through the constructor, like the attention's
    values[target.expert_count_key] = num_experts
    values.update(num_experts_per_tok=top_k, output_router_logits=False)
    values["attn_implementation"] = configured_attention(config)  # the dense model's, through the constructor
    if target.moe_prefix == "Mixtral":
        values["router_jitter_noise"] = jitter_noise
    else:  # Qwen2-MoE: every layer sparse, experts as wide as the dense MLP, renormalised top-k
        values.update(
            moe_intermediate_size=config.intermediate_size,
            shared_expert_intermediate_size=shared,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            qkv_bias=True,
        )
    moe_config = getattr(transformers, target.config_class)(**values)
    moe_config.dtype = config.dtype
    return moe_config


@torch.no_grad()
def _upcycled_block(mlp: nn.Module, config, *, num_experts: int, top_k: int, shared: int | None, **moe_kwargs):
    weight = mlp.gate_proj.weight  # [I, H]
    inter, hidden = weight.shape
    with warnings.catch_warnings():  # a zero-width shared expert is a deliberate placeholder
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        layer = MoELayer(
            hidden, inter, num_experts=num_experts, top_k=top_k, hidden_act=config.hidden_act,
            normalize_top_k=True, shared_expert_intermediate_size=shared, device=weight.device, dtype=weight.dtype,
            **moe_kwargs,
        )  # fmt: skip
    nn.init.normal_(layer.gate.weight, std=config.initializer_range)
    fused = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)  # [2I, H]
    layer.experts.gate_up_proj.copy_(fused.expand(num_experts, -1, -1))
    layer.experts.down_proj.copy_(mlp.down_proj.weight.expand(num_experts, -1, -1))
    if layer.shared_expert is not None:  # starts silent (zero output projection), so outputs stay the dense ones
        layer.shared_expert.down_proj.weight.zero_()
        layer.shared_expert_gate.weight.zero_()
    return layer


def _check_full_precision(model: nn.Module) -> None:
    """Experts are copies of plain MLP weights: a quantized model (DKM, bitsandbytes, ...) is upcycled before it is
    quantized, never after (DKM then clusters the upcycled model's Linear layers; the fused experts stay full)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    method = getattr(quantizer.quantization_config, "quant_method", "?")
    method = getattr(method, "value", method)
    then = "then quantize_model(moe_model, DKMConfig(...))" if method == "dkm" else "then quantize the MoE model"
    raise ValueError(
        f"upcycle_to_moe needs a full-precision dense model, this one is quantized ({method}): upcycle the "
        f"unquantized model first, {then}"
    )


def upcycle_to_moe(
    model: nn.Module,
    *,
    num_experts: int,
    top_k: int = 2,
    capacity_factor: float | None = None,
    jitter_noise: float = 0.0,
    shared_expert_intermediate_size: int = 0,
) -> nn.Module:
    """Turn every MLP of a dense Llama / Mistral / Qwen2 model into a mixture of experts, copies of that MLP.

    Returns a new model of transformers' native MoE class (`LlamaForCausalLM` -> `MixtralForCausalLM`,
    `Qwen2ForCausalLM` -> `Qwen2MoeForCausalLM`, ...) that shares the dense model's non-MLP tensors; use it
    instead of the dense model. Its sparse blocks are transformers' own, computing their experts through
    `experts_implementation="llmkit"` (`hf_llmkit.parallel.moe.registry`), or `MoELayer`s where those blocks cannot
    route as asked (`capacity_factor`, Qwen2 with `jitter_noise`). Right after upcycling its outputs equal the
    dense model's: the top-k weights are renormalised and every expert is the dense MLP. The router starts random
    (normal, `initializer_range`) so training can specialise the experts.

    Args:
        model: a dense `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` (or another head class of
            those families that the MoE family also has).
        num_experts: experts per layer.
        top_k: experts per token.
        capacity_factor: see `MoELayer` (None = dropless; the exported model is always dropless). Set, the blocks
            are `MoELayer`s: the capacity is a routing decision transformers' blocks cannot make.
        jitter_noise: input jitter in training (exported as Mixtral's `router_jitter_noise`; Mixtral's block scales
            its whole input, experts included, `MoELayer`'s the router's only). Qwen2-MoE has no jitter: with it,
            a Qwen2 model gets `MoELayer` blocks.
        shared_expert_intermediate_size: Qwen2 only: width of Qwen2-MoE's shared expert; it starts with a zero
            output projection. 0 (default) exports a zero-width shared expert, which adds exactly nothing.
    """
    _check_full_precision(model)
    target, moe_cls = _target_for(model)
    if target.moe_prefix != "Qwen2Moe" and shared_expert_intermediate_size:
        raise ValueError("shared_expert_intermediate_size applies to Qwen2 models (Qwen2-MoE) only; leave it at 0")
    if shared_expert_intermediate_size < 0:
        raise ValueError(f"shared_expert_intermediate_size must be >= 0, got {shared_expert_intermediate_size}")
    dense_config = model.config
    shared = shared_expert_intermediate_size if target.moe_prefix == "Qwen2Moe" else None
    blocks = {}
    for name, module in model.named_modules():
        if name.endswith(".mlp") and hasattr(module, "gate_proj"):
            blocks[name] = _upcycled_block(
                module, dense_config, num_experts=num_experts, top_k=top_k, shared=shared,
                capacity_factor=capacity_factor, jitter_noise=jitter_noise,
            )  # fmt: skip
    # transformers' own blocks, our experts through its registry; MoELayer where the block cannot do it: a capacity
    # limit, and router jitter in Qwen2-MoE (which has none)
    native = capacity_factor is None and (jitter_noise == 0 or target.moe_prefix == "Mixtral")
    moe_config = _moe_config(
        dense_config, target, num_experts=num_experts, top_k=top_k, jitter_noise=jitter_noise, shared=shared or 0,
        experts=register_experts_implementation() if native else None,
    )  # fmt: skip
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        moe_model = moe_cls(moe_config)
    state = {k: v for k, v in model.state_dict().items() if not any(k.startswith(n + ".") for n in blocks)}
    for name, block in blocks.items():
        if native:  # MoELayer's state dict is the native block's: its tensors move into the native block
            state.update({f"{name}.{key}": value for key, value in block.state_dict().items()})
        else:
            moe_model.set_submodule(name, block)
    missing, unexpected = moe_model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if native or not any(k.startswith(n + ".") for n in blocks)]
    if unexpected or missing:  # the architectures drifted apart: refuse rather than leave random tensors
        raise ValueError(f"cannot map {type(model).__name__} onto {moe_cls.__name__}: {missing=} {unexpected=}")
    _rebuild_meta_buffers(moe_model, device=next(model.parameters()).device)
    if moe_config.tie_word_embeddings:
        moe_model.tie_weights()
    moe_model.generation_config = model.generation_config
    return moe_model.train(model.training)


def _rebuild_meta_buffers(model: nn.Module, *, device: torch.device) -> None:
    """Non-persistent buffers (rotary `inv_freq`) are not in a state dict: build those modules again."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not hasattr(module, "config"):
                raise ValueError(f"cannot rebuild buffers of {name} ({type(module).__name__}) after upcycling")
            with torch.device(device):
                model.set_submodule(name, type(module)(config=module.config))


@torch.no_grad()
def use_moe_layers(
    model: nn.Module, *, capacity_factor: float | None = None, ep_group: torch.distributed.ProcessGroup | None = None
) -> nn.Module:
    """Replace the native sparse blocks of a Mixtral / Qwen2-MoE model by equivalent `MoELayer`s, in place.

    The state-dict keys do not change, so the model still saves as the native checkpoint (with
    `ep_group`, each rank holds only its experts: gather them before saving).
    """
    config, replaced = model.config, 0
    for name, block in list(model.named_modules()):
        if not is_native_moe_block(block):
            continue
        shared = getattr(block, "shared_expert", None)
        gate_up = block.experts.gate_up_proj  # [E, 2I, H]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
            layer = MoELayer(
                gate_up.shape[2], gate_up.shape[1] // 2, num_experts=gate_up.shape[0],
                top_k=config.num_experts_per_tok,
                hidden_act=config.hidden_act, normalize_top_k=getattr(config, "norm_topk_prob", True),
                jitter_noise=getattr(config, "router_jitter_noise", 0.0), capacity_factor=capacity_factor,
                shared_expert_intermediate_size=None if shared is None else shared.gate_proj.weight.shape[0],
                ep_group=ep_group, device=gate_up.device, dtype=gate_up.dtype,
            )  # fmt: skip
        state = block.state_dict()
        if ep_group is not None:
            lo, n = layer.ep_rank * layer.num_local_experts, layer.num_local_experts
            state["experts.gate_up_proj"] = state["experts.gate_up_proj"][lo : lo + n]
            state["experts.down_proj"] = state["experts.down_proj"][lo : lo + n]
        layer.load_state_dict(state)
        model.set_submodule(name, layer.train(block.training))
        replaced += 1
    if not replaced:
        raise ValueError(f"{type(model).__name__} has no Mixtral or Qwen2-MoE sparse blocks to replace")
    return model
