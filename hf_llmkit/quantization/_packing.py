"""Pack n-bit indices (1-8 bits) into a flat uint8 tensor and back, little-endian within each byte.

`N` indices of `b` bits take `ceil(N * b / 8)` bytes, so a 3-bit table index costs 3/16 of a bf16 weight.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 21  # indices per step: keeps the [chunk, bits] temporaries small


def packed_numel(count: int, bits: int) -> int:
    """Bytes that `count` indices of `bits` bits pack into."""
    return (count * bits + 7) // 8


def pack_indices(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat uint8 tensor of `packed_numel(indices.numel(), bits)` bytes holding every index in `bits` bits."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1-8, got {bits}")
    flat = indices.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= 1 << bits):
        raise ValueError(f"indices must lie in [0, {1 << bits}) to be packed in {bits} bits")
    # Index i occupies bits [i*bits, (i+1)*bits) of a little-endian bit stream: 8 indices fill `bits` whole bytes,
    # so each group of 8 is one 64-bit integer whose low `bits` bytes are the group's bytes.
    packed = torch.empty(packed_numel(flat.numel(), bits), dtype=torch.uint8, device=flat.device)
    shifts = torch.arange(8, device=flat.device, dtype=torch.int64) * bits
    bytes_out = torch.arange(bits, device=flat.device, dtype=torch.int64) * 8
    for start in range(0, flat.numel(), CHUNK):  # CHUNK is a multiple of 8: chunks are whole groups
        part = flat[start : start + CHUNK]
        groups = torch.nn.functional.pad(part, (0, (-part.numel()) % 8)).view(-1, 8)
        word = (groups << shifts).sum(-1, keepdim=True)  # disjoint bit fields: the sum is their OR
        chunk = ((word >> bytes_out) & 255).to(torch.uint8).view(-1)
        first = start * bits // 8
        packed[first : first + min(chunk.numel(), packed.numel() - first)] = chunk[: packed.numel() - first]
    return packed


def unpack_indices(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` indices (int64) of a tensor written by `pack_indices`."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != packed_numel(count, bits):
        raise ValueError(
            f"packed indices must be a flat uint8 tensor of {packed_numel(count, bits)} bytes for {count} "
            f"indices of {bits} bits, got {tuple(packed.shape)} {packed.dtype}"
        )
    return unpack_words(packed, bits)[:count].to(torch.int64)


def unpack_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Every index a `pack_indices` stream holds, padding included (a multiple of 8), decoded with whole-tensor ops:
    each `bits` bytes are one little-endian word of 8 indices (int32 up to 3 bits, else int64)."""
    words = -(-packed.numel() // bits)  # 8 indices per `bits` bytes
    if packed.numel() < words * bits:
        packed = torch.cat([packed, packed.new_zeros(words * bits - packed.numel())])
    dtype = torch.int32 if bits <= 3 else torch.int64
    parts = packed.view(words, bits).to(dtype)  # [words, bits]
    word = parts[:, 0]
    for i in range(1, bits):
        word = word | (parts[:, i] << (8 * i))
    shifts = torch.arange(0, 8 * bits, bits, device=packed.device, dtype=dtype)
    return ((word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(-1)  # [words * 8]
