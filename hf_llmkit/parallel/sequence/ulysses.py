"""Ulysses sequence parallelism for transformers models: the outermost layer of hf_llmkit's attention stack.

Each rank of a sequence-parallel (SP) group holds `S / P` consecutive tokens of every sample. In each attention
layer the wrapper exchanges query/key/value with one all-to-all so that every rank holds the FULL sequence for
`H / P` heads, runs the rest of the attention stack (P-tuning v2 prefixes, if any, then the model's own kernel:
sdpa, eager, flash) on it, and exchanges the output back to sequence shards. Everything outside attention
(embeddings, MLPs, norms, the LM head) is per-token and runs on the local shard unchanged.

    from hf_llmkit.parallel import apply_sequence_parallel, new_sequence_parallel_groups

    groups = new_sequence_parallel_groups(sp_size=2)
    apply_sequence_parallel(model, group=groups.sp_group)   # the model now runs "llmkit_ulysses_sdpa@..."

The wrapper is installed through `hf_llmkit.parallel.attention` (transformers' public attention API), so it
stacks with P-tuning v2 in either order of application. The model's mask code runs on the local shard; the mask
function registered with our attention name passes the local 2D padding mask through unchanged, and the wrapper
gathers it and builds the mask for the full sequence with transformers' own mask function of the kernel (causal,
sliding-window or bidirectional).

Packed sequences (several documents in one row, `position_ids` restarting at 0 at each, no attention mask) stay
apart as on one rank: the wrapper gathers the `position_ids` of the full sequence, finds the documents as
transformers' own mask code does without a mask (`find_packed_sequence_indices`) and builds the full-sequence mask
with its packed-sequence rule (a token attends within its own document only); the kernel gets the full sequence's
`position_ids` (flash kernels read the document boundaries from them).

Limits: training and evaluation only (no KV cache); attention weights are not returned. With eager attention, a
fully masked query row (a left-padding position) averages over all keys, so padding the length to a multiple of P
changes that row's output -- it matters only when such a position has a label (sdpa is exact).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers.masking_utils import (
    bidirectional_mask_function,
    causal_mask_function,
    find_packed_sequence_indices,
    packed_sequence_compatibility_function,
    sliding_window_causal_mask_function,
)

from hf_llmkit.parallel.attention import (
    AttentionCall,
    AttentionLayer,
    ModuleView,
    add_attention_layer,
    attention_layer,
    head_sharded_kwargs,
    kernel_mask_function,
    remove_attention_layer,
)

# Kernels whose call convention and mask builder we know; flash is used only when installed.
WRAPPABLE = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4")


class _Exchange(torch.autograd.Function):
    """all-to-all over the leading dim (chunk j goes to rank j); it is its own inverse, so backward = forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[B, H, S/P, D]` sequence-sharded -> `[B, H/P, S, D]` head-sharded (HF's query/key/value layout)."""
    p = dist.get_world_size(group)
    b, h, s, d = x.shape
    x = x.reshape(b, p, h // p, s, d).permute(1, 0, 2, 3, 4)  # [P, B, H/P, S/P, D], chunk j -> rank j
    x = _Exchange.apply(x, group)  # [P, B, H/P, S/P, D], chunk j came from rank j = sequence block j
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, d)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[B, S, H/P, D]` head-sharded attention output -> `[B, S/P, H, D]` sequence-sharded."""
    p = dist.get_world_size(group)
    b, s, h, d = x.shape
    x = x.reshape(b, p, s // p, h, d).permute(1, 0, 2, 3, 4)  # [P, B, S/P, H/P, D]
    x = _Exchange.apply(x, group)  # chunk j came from rank j = head block j
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // p, p * h, d)


def kv_replication(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many times each key/value head is repeated so the heads split evenly over `sp_size` ranks."""
    if num_heads % sp_size:
        raise ValueError(
            f"num_attention_heads={num_heads} is not divisible by sequence_parallel_size={sp_size}; "
            f"use a sequence_parallel_size that divides {num_heads}"
        )
    if num_kv_heads % sp_size == 0:
        return 1
    if sp_size % num_kv_heads == 0:
        return sp_size // num_kv_heads
    raise ValueError(
        f"num_key_value_heads={num_kv_heads} and sequence_parallel_size={sp_size}: one must divide the other "
        "(kv heads are split over the ranks, or replicated when there are fewer of them than ranks)"
    )


def _local_padding_mask(attention_mask: torch.Tensor | None, **_: Any) -> torch.Tensor | None:
    """Mask builder registered for our attention names: hand the local 2D padding mask to the wrapper unchanged."""
    return attention_mask


def _rank_heads(t: torch.Tensor, dim: int, repeat: int, rank: int, sp_size: int) -> torch.Tensor:
    """The key/value heads of a per-head tensor (e.g. a P-tuning v2 prefix) that this rank holds after exchange."""
    if repeat > 1:
        t = t.repeat_interleave(repeat, dim=dim)
    n = t.shape[dim] // sp_size
    return t.narrow(dim, rank * n, n)


class UlyssesAttention(AttentionLayer):
    """The Ulysses layer of the attention stack for one SP group."""

    kind = "ulysses"
    order = 0
    name_prefix = "llmkit_ulysses_"

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.sp_size = dist.get_world_size(group)
        self.sp_rank = dist.get_rank(group)
        self._mask_cache: tuple | None = None
        self._positions_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def name_suffix(self) -> str:
        return f"@{id(self.group):x}"

    def check_kernel(self, kernel: str) -> None:
        if kernel not in WRAPPABLE:
            raise ValueError(
                f"attention implementation {kernel!r} cannot be wrapped for sequence parallelism; load the model "
                f"with attn_implementation set to one of {', '.join(WRAPPABLE)}"
            )

    def mask_function(self, kernel: str):
        return _local_padding_mask

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """`[B, S/P]` on each rank of the group -> `[B, S]`."""
        parts = [torch.empty_like(local) for _ in range(self.sp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def _full_positions(self, local: torch.Tensor | None, batch: int) -> torch.Tensor | None:
        """The `position_ids` of the full sequence `[B, S]` from this rank's shard (gathered once per forward)."""
        if local is None:
            return None
        if self._positions_cache is not None and self._positions_cache[0] is local:
            return self._positions_cache[1]
        full = self._gather(local.expand(batch, -1))
        self._positions_cache = (local, full)  # holding `local` keeps its identity unique while cached
        return full

    def _full_mask(
        self, module, kernel: str, local: torch.Tensor | None, query: torch.Tensor, seq: int, positions, kwargs
    ):
        """The mask the kernel would get for the full sequence (built once per forward)."""
        sliding_window = kwargs.get("sliding_window")
        key = (kernel, query.shape[0], seq, query.dtype, query.device, sliding_window)
        cached = self._mask_cache
        if cached is not None and cached[0] == key and cached[1] is local and cached[3] is positions:
            return cached[2]
        full_padding = None
        if local is not None:
            if local.dim() != 2:
                raise ValueError(
                    f"sequence parallel attention needs a 2D padding attention_mask, got shape {tuple(local.shape)}; "
                    "pass the tokenizer's [batch, seq] mask, not a prepared 4D mask"
                )
            full_padding = self._gather(local)  # [B, S]
        if not getattr(module, "is_causal", True):
            pattern = bidirectional_mask_function
        elif sliding_window is not None and not kernel.startswith("flash"):
            pattern = sliding_window_causal_mask_function(sliding_window)
        else:
            pattern = causal_mask_function
        # packed documents (positions restarting, no mask): a token sees its own document only, as transformers'
        # mask code decides on one rank
        documents = find_packed_sequence_indices(positions) if positions is not None and local is None else None
        if documents is not None:
            pattern = packed_sequence_compatibility_function(pattern, positions, documents)
        mask = kernel_mask_function(kernel)(
            batch_size=query.shape[0],
            q_length=seq,
            kv_length=seq,
            q_offset=0,
            kv_offset=0,
            mask_function=pattern,
            attention_mask=full_padding,
            allow_is_causal_skip=documents is None,
            dtype=query.dtype,
            config=module.config,
            use_vmap=False,
            device=query.device,
        )
        self._mask_cache = (key, local, mask, positions)  # holding `local` keeps its identity unique while cached
        return mask

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,  # [B, H, S/P, D]
        key: torch.Tensor,  # [B, Hkv, S/P, D]
        value: torch.Tensor,  # [B, Hkv, S/P, D]
        attention_mask: torch.Tensor | None,
        *,
        inner: AttentionCall,
        kernel: str,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            raise ValueError("sequence parallel attention is for training/evaluation; call remove_sequence_parallel")
        p = self.sp_size
        num_heads, num_kv = query.shape[1], key.shape[1]
        repeat = kv_replication(num_heads, num_kv, p)
        if repeat > 1:  # fewer kv heads than ranks: each rank needs a copy of the kv head its queries use
            key = key.repeat_interleave(repeat, dim=1)  # [B, P, S/P, D]
            value = value.repeat_interleave(repeat, dim=1)
        q, k, v = (sequence_to_heads(t, self.group) for t in (query, key, value))  # [B, heads/P, S, D]
        for name, dim in head_sharded_kwargs().items():  # e.g. P-tuning v2 prefixes: keep this rank's kv heads
            if kwargs.get(name) is not None:
                kwargs[name] = _rank_heads(kwargs[name], dim, repeat, self.sp_rank, p)
        seq = q.shape[2]
        positions = self._full_positions(kwargs.pop("position_ids", None), q.shape[0])  # [B, S]
        mask = self._full_mask(module, kernel, attention_mask, q, seq, positions, kwargs)
        groups = q.shape[1] // k.shape[1]
        target = module
        if groups != getattr(module, "num_key_value_groups", groups):
            target = ModuleView(module, num_key_value_groups=groups)
        if positions is not None:  # the full sequence's (RoPE was applied before this call, on the shard's)
            kwargs["position_ids"] = positions
        out, _ = inner(target, q, k, v, mask, **kwargs)  # [B, S, H/P, D]
        return heads_to_sequence(out, self.group), None  # [B, S/P, H, D]


def _check_heads(model: nn.Module, sp_size: int) -> None:
    from transformers import PreTrainedModel

    for sub in model.modules():
        if isinstance(sub, PreTrainedModel):
            heads = getattr(sub.config, "num_attention_heads", None)
            if heads is not None:
                kv_replication(heads, getattr(sub.config, "num_key_value_heads", None) or heads, sp_size)


def apply_sequence_parallel(
    model: nn.Module, *, group: dist.ProcessGroup | None = None, mesh: Any = None, mesh_dim: str = "sp"
) -> nn.Module:
    """Make `model`'s attention Ulysses sequence-parallel over `group` (or `mesh[mesh_dim]`); returns `model`.

    The current kernel (sdpa, eager or flash-attention) stays the inner attention, and other attention layers
    (P-tuning v2 prefixes) stay inside, whether they were added before or after. Inputs must then be sequence
    shards (see `shard_sequence_batch`) with global `position_ids`. Idempotent for the same group.
    Raises `ValueError` when the heads do not split over the group or the kernel cannot be wrapped.
    """
    if (group is None) == (mesh is None):
        raise ValueError("pass exactly one of group= (a ProcessGroup) or mesh= (a DeviceMesh with an 'sp' dim)")
    if mesh is not None:
        group = mesh.get_group(mesh_dim)
    if not dist.is_initialized():
        raise ValueError("apply_sequence_parallel needs torch.distributed initialised (init_process_group first)")
    current = attention_layer(model, UlyssesAttention.kind)
    if current is not None and current.group is group:
        return model
    _check_heads(model, dist.get_world_size(group))
    return add_attention_layer(model, UlyssesAttention(group))


def remove_sequence_parallel(model: nn.Module) -> nn.Module:
    """Take the Ulysses layer out of `model`'s attention (e.g. before generation); other layers stay."""
    return remove_attention_layer(model, UlyssesAttention.kind)


def sequence_parallel_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The SP group `model` was wrapped for, or None when it is not sequence parallel."""
    layer = attention_layer(model, UlyssesAttention.kind)
    return layer.group if layer is not None else None
