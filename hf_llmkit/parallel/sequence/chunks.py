"""Sequence chunks whose gradients land in one buffer: the split under the tiled loss and the tiled MLP.

Slicing a tensor into chunks with plain indexing costs, in the backward, one zero-filled tensor of the FULL size
per chunk (each slice's backward scatters its chunk's gradient into one) plus the running sum of them: two to three
full-size tensors alive at once, which is what tiling is meant to avoid. `sequence_chunks` returns views whose
backward copies each chunk's gradient into a single full-size buffer as it arrives and hands the buffer on when the
last chunk's has arrived: one full-size tensor plus one chunk.

The chunks are made one at a time, as the caller iterates: each chunk's backward node then sits right after its
computation's, so the backward copies each chunk's gradient into the buffer (and frees it) before moving on to the
next chunk, instead of holding all of them.

Every chunk must contribute to the result being differentiated (the tiled loss sums all of them; the tiled MLP
concatenates all of them): a chunk whose backward never runs would leave the buffer unfinished.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class _Share:
    """The gradient buffer the chunks of one split fill."""

    def __init__(self, total: int) -> None:
        self.total, self.arrived = total, 0
        self.buffer: torch.Tensor | None = None


class _Chunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, length: int, dim: int, share: _Share) -> torch.Tensor:
        ctx.start, ctx.length, ctx.dim, ctx.share, ctx.shape = start, length, dim, share, x.shape
        return x.narrow(dim, start, length)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        share = ctx.share
        if share.buffer is None:
            share.buffer = grad.new_zeros(ctx.shape)
        share.buffer.narrow(ctx.dim, ctx.start, ctx.length).copy_(grad)
        share.arrived += 1
        if share.arrived < share.total:
            return None, None, None, None, None
        full, share.buffer = share.buffer, None
        return full, None, None, None, None


def sequence_chunks(x: torch.Tensor, chunks: int, *, dim: int = 1) -> Iterator[torch.Tensor]:
    """`x` in `chunks` consecutive pieces along `dim` (sizes differ by at most one), made one at a time as the
    caller iterates, with one shared gradient buffer."""
    size = x.shape[dim]
    bounds = [size * i // chunks for i in range(chunks + 1)]
    tracked = x.requires_grad and torch.is_grad_enabled()
    share = _Share(chunks)
    for start, stop in zip(bounds, bounds[1:]):
        yield _Chunk.apply(x, start, stop - start, dim, share) if tracked else x.narrow(dim, start, stop - start)
