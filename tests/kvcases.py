"""Random injection cases shared by the write-path tests (no vLLM, no infrastructure)."""

from __future__ import annotations

import torch

from inferscale.contracts.kv_format import quantize

BF16 = torch.bfloat16


def kv_case(gen: torch.Generator, layers: int, heads: int, dim: int, block_size: int,
            lengths: list[int], skips: list[int], start: int, scaled: bool,
            device: torch.device | str = "cpu", formats: list[str] | None = None):
    """Pieces ``[layers, length, heads, dim]`` (each a view that skips its blob's first
    ``skip`` tokens; stored in ``formats``, one per piece, else raw (K, V) pairs), positions
    from ``start``, slots in shuffled blocks, key scales or None, and the shape of a cache
    ``[blocks, heads, block_size, 2 * dim]`` that holds them."""
    pieces = []
    for n, (length, skip) in enumerate(zip(lengths, skips, strict=True)):
        k, v = torch.randn(2, layers, length + skip, heads, dim, generator=gen).to(BF16)
        if formats is None:
            pieces.append((k[:, skip:].to(device), v[:, skip:].to(device)))
        else:
            pieces.append(quantize(k, v, formats[n]).sliced(skip).to(torch.device(device)))
    tokens = sum(lengths)
    positions = torch.arange(start, start + tokens)
    blocks = (start + tokens) // block_size + 2
    order = torch.randperm(blocks, generator=gen)
    slots = order[positions // block_size] * block_size + positions % block_size
    scales = (torch.rand(layers, tokens, generator=gen) + 0.5).to(BF16) if scaled else None
    return pieces, positions, slots, scales, (blocks, heads, block_size, 2 * dim)
