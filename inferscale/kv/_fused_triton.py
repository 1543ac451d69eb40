"""The fused KV write as one Triton kernel, for vLLM's CUDA paged cache (``kvwrite.py``).

One program per (token, layer): read the token's stored key and value rows of that layer
(through a table of row addresses, so the facts' blobs are read where they lie), rotate the
key to the token's position (and scale it) and store both in the layer's block layout
``[blocks, heads, block_size, 2 * head_dim]`` (K in the first half of the last dimension, V in
the second), at the token's slot. Rounding follows one of two rotary kernels, as the chain
rounds with it: ``ROUND_ONCE`` each rotated element computed in fp32 and rounded to bf16 once
(vLLM's CPU kernel), else every product and sum rounded to bf16 (torch's bf16 ops; c10's
BFloat16 arithmetic rounds so too). Products of two bf16 values are exact in fp32, so neither
depends on fused multiply-adds. Values reach memory only as bf16 values exactly, so the final
casts round nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 value, ties to even, kept as fp32. Integer ops,
    so that Triton's interpreter (whose casts truncate) rounds as the GPU and torch do."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def inject_kernel(keys, values, layer_strides, positions, slots, cos_sin, scales, caches,
                  tokens, block_size, stride_block, stride_head, stride_slot,
                  HEADS: tl.constexpr, DIM: tl.constexpr, ROT: tl.constexpr,
                  HEADS_P2: tl.constexpr, HALF_P2: tl.constexpr, REST_P2: tl.constexpr,
                  DIM_P2: tl.constexpr, SCALED: tl.constexpr, ROUND_ONCE: tl.constexpr):
    token = tl.program_id(0)
    layer = tl.program_id(1)
    offset = tl.load(layer_strides + token) * layer
    key_row = tl.load(keys + token).to(tl.pointer_type(tl.bfloat16)) + offset
    value_row = tl.load(values + token).to(tl.pointer_type(tl.bfloat16)) + offset
    position = tl.load(positions + token)
    slot = tl.load(slots + token)
    cache = tl.load(caches + layer).to(tl.pointer_type(tl.bfloat16))
    out = cache + (slot // block_size) * stride_block + (slot % block_size) * stride_slot
    heads = tl.arange(0, HEADS_P2)[:, None]
    scale = 1.0
    if SCALED:
        scale = tl.load(scales + layer * tokens + token).to(tl.float32)

    half = ROT // 2
    d = tl.arange(0, HALF_P2)[None, :]
    rotated = (heads < HEADS) & (d < half)
    x = tl.load(key_row + heads * DIM + d, mask=rotated).to(tl.float32)
    y = tl.load(key_row + heads * DIM + d + half, mask=rotated).to(tl.float32)
    cos = tl.load(cos_sin + position * ROT + d, mask=d < half).to(tl.float32)
    sin = tl.load(cos_sin + position * ROT + half + d, mask=d < half).to(tl.float32)
    if SCALED:
        cos = _bf16(cos * scale)
        sin = _bf16(sin * scale)
    if ROUND_ONCE:
        first = _bf16(x * cos - y * sin)
        second = _bf16(y * cos + x * sin)
    else:
        first = _bf16(_bf16(x * cos) - _bf16(y * sin))
        second = _bf16(_bf16(y * cos) + _bf16(x * sin))
    tl.store(out + heads * stride_head + d, first.to(tl.bfloat16), mask=rotated)
    tl.store(out + heads * stride_head + d + half, second.to(tl.bfloat16), mask=rotated)

    if ROT < DIM:  # the dimensions RoPE leaves alone: scaled only
        r = ROT + tl.arange(0, REST_P2)[None, :]
        rest = (heads < HEADS) & (r < DIM)
        kept = tl.load(key_row + heads * DIM + r, mask=rest).to(tl.float32)
        if SCALED:
            kept = _bf16(kept * scale)
        tl.store(out + heads * stride_head + r, kept.to(tl.bfloat16), mask=rest)

    v = tl.arange(0, DIM_P2)[None, :]
    row = (heads < HEADS) & (v < DIM)
    tl.store(out + heads * stride_head + DIM + v,
             tl.load(value_row + heads * DIM + v, mask=row), mask=row)
