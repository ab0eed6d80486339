"""Tiled MLP (ALST): each decoder layer's MLP applied in sequence chunks, each chunk under checkpointing.

An MLP is per-token, so running it on chunks of positions gives the same output. Under non-reentrant activation
checkpointing per chunk, the forward keeps only the MLP input alive for backward (not the `[S, intermediate]`
activations, several times the hidden size), and the backward recomputes one chunk's activations at a time.

It is installed with module hooks on the model's own MLP modules (nothing is replaced, state-dict keys do not
change): a forward pre-hook hands the module an empty slice of its input, so the module's own call costs nothing,
and a forward hook returns the chunked result computed from the real input with the module's `forward`.
Submodule hooks (DeepSpeed ZeRO-3 gathering, LoRA layers on the projections) run for every chunk.

Mixture-of-experts blocks (`MoELayer`, transformers' sparse blocks) are tiled too: dropless routing sends each token
to its experts whatever the other tokens are, so the chunks' outputs are exactly the block's, and the blocks'
auxiliary losses are computed from what all chunks routed (`hf_llmkit.parallel.moe.routing_stats`). A capacity limit
is per call, so a block with `capacity_factor` is refused.

    tiling = TiledMLP(model, chunk_size=512)   # ... train ...
    tiling.remove()
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_llmkit.parallel.sequence.chunks import sequence_chunks
from hf_llmkit.parallel.sequence.tiled_loss import chunk_count


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """The `mlp` modules of the decoder layers of `model` (layers that also hold a `self_attn`)."""
    found = []
    for module in model.modules():
        mlp = getattr(module, "mlp", None)
        if isinstance(mlp, nn.Module) and hasattr(module, "self_attn") and mlp not in found:
            found.append(mlp)
    return found


class _TiledModule:
    """The hooks of one MLP module."""

    def __init__(self, module: nn.Module, owner: TiledMLP) -> None:
        self.module, self.owner = module, owner
        self._pending: tuple[tuple, dict] | None = None
        self.handles = [
            module.register_forward_pre_hook(self._before, with_kwargs=True),
            module.register_forward_hook(self._after, with_kwargs=True),
        ]

    def _before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        x = args[0] if args else None
        if not (torch.is_tensor(x) and x.dim() == 3):
            return None
        chunks = self.owner.chunks_for(x.shape[1])
        if chunks == 1 and self.owner.chunks is None:
            return None  # short input: one chunk is the module itself
        self._pending = (args, kwargs)
        return (x[:, :0], *args[1:]), kwargs  # the module's own call runs on no position

    def _after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any):
        if self._pending is None:
            return None
        (x, *rest), kw = self._pending
        self._pending = None
        n = self.owner.chunks_for(x.shape[1])
        outs = [
            checkpoint(self._chunk, part, *rest, use_reentrant=False, **kw)  # [B, c, H]
            for part in sequence_chunks(x, n)
        ]
        return torch.cat(outs, dim=1)  # [B, S, H]

    def _chunk(self, part: torch.Tensor, *rest: Any, **kw: Any) -> torch.Tensor:
        # contiguous whatever the chunk's strides (a view, or an offloaded copy when recomputed): same kernels
        return self.module.forward(part.contiguous(), *rest, **kw)


class TiledMLP:
    """Tile the MLP of every decoder layer of `model` over the sequence.

    Args:
        model: the model (or a wrapper around it).
        chunk_size: positions per chunk; 0 = the model's hidden size (ALST's choice).
    """

    def __init__(self, model: nn.Module, *, chunk_size: int = 0) -> None:
        modules = mlp_modules(model)
        if not modules:
            raise ValueError(
                f"found no decoder-layer MLP (an `mlp` next to a `self_attn`) in {type(model).__name__}; "
                "turn tiled_mlp off for this model"
            )
        for mlp in modules:
            if getattr(mlp, "capacity_factor", None) is not None:
                raise ValueError(
                    f"tiled_mlp cannot tile {type(mlp).__name__} with capacity_factor={mlp.capacity_factor}: the "
                    "capacity is per call, so chunks would drop other tokens; use dropless routing "
                    "(capacity_factor=None) or turn tiled_mlp off"
                )
        if chunk_size < 0:
            raise ValueError(f"tiled MLP chunk_size must be >= 1 (or 0 for the hidden size), got {chunk_size}")
        if chunk_size == 0:
            config = getattr(model, "config", None) or getattr(modules[0], "config", None)
            chunk_size = getattr(config, "hidden_size", None) or 1024
        self.chunk_size = chunk_size
        self.chunks: int | None = None  # a fixed count for every call (ranks gathering parameters must agree)
        self._tiled = [_TiledModule(mlp, self) for mlp in modules]

    def chunks_for(self, length: int) -> int:
        return self.chunks if self.chunks is not None else chunk_count(length, self.chunk_size)

    def remove(self) -> None:
        for tiled in self._tiled:
            for handle in tiled.handles:
                handle.remove()
