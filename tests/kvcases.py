"""Random injection cases shared by the write-path tests (no vLLM, no infrastructure)."""

from __future__ import annotations

import torch

from inferscale.contracts.kv_format import FP8, KVPiece, quantize
from inferscale.kv.chain import SKIP, LayerSlots

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


def window_slots(gen: torch.Generator, positions: torch.Tensor, block_size: int, blocks: int,
                 layers: int, window: int) -> LayerSlots:
    """Slots as vLLM's hybrid KV cache manager gives them: two groups of layers (every other
    layer in the second), each with its own shuffled blocks, the second (sliding) keeping only
    the blocks that hold the last ``window`` positions (``SKIP`` before them)."""
    table = torch.stack([torch.randperm(blocks, generator=gen)[positions // block_size]
                         * block_size + positions % block_size for _ in range(2)])
    first_kept = max(int(positions[-1]) + 1 - window, 0) // block_size * block_size
    table[1, positions < first_kept] = SKIP
    return LayerSlots(table, torch.arange(layers) % 2)


def every_e4m3_code(gen: torch.Generator, layers: int, heads: int, dim: int) -> KVPiece:
    """An fp8 piece whose K and V rows of each layer hold every finite e4m3 code (0x7F and 0xFF,
    NaN, are never written) in a random order, with random (scale, zero) params: what each
    writer must dequantise as torch's float8_e4m3fn does."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 127) != 127]
    tokens = -(-codes.numel() // (heads * dim))
    cells = tokens * heads * dim
    rows = codes.repeat(-(-cells // codes.numel()))[:cells]

    def shuffled() -> torch.Tensor:
        return torch.stack([rows[torch.randperm(cells, generator=gen)] for _ in range(layers)]
                           ).view(layers, tokens, heads, dim)

    def params(*shape: int) -> torch.Tensor:
        scale = torch.rand(*shape, generator=gen) + 0.01
        return torch.stack([scale, torch.randn(*shape, generator=gen)], dim=-1).to(BF16)

    return KVPiece(k=shuffled(), v=shuffled(), kv_format=FP8,
                   k_params=params(layers, heads, dim).transpose(-1, -2).contiguous(),
                   v_params=params(layers, tokens, heads), out_dtype=BF16)


def rope_config(layers: int, heads: int, dim: int, partial: float, per_layer: bool,
                max_position: int = 4096):
    """A config whose RoPE turns ``partial`` of each head's ``dim`` dimensions: one table for
    every layer (Llama), or ``per_layer`` a local and a global one, layers alternating
    (Gemma 3's sliding and full layers)."""
    from transformers import Gemma3TextConfig, LlamaConfig

    common = dict(hidden_size=2 * heads * dim, num_attention_heads=2 * heads,
                  num_key_value_heads=heads,
                  head_dim=dim, max_position_embeddings=max_position, num_hidden_layers=layers,
                  intermediate_size=64, vocab_size=100)
    if not per_layer:
        return LlamaConfig(**common, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial})
    kinds = ["sliding_attention", "full_attention"]
    return Gemma3TextConfig(**common, sliding_window=64,
                            layer_types=[kinds[i % 2] for i in range(layers)],
                            rope_parameters={
                                kind: {"rope_type": "default", "rope_theta": theta,
                                       "partial_rotary_factor": partial}
                                for kind, theta in zip(kinds, (1e4, 1e6), strict=True)})
