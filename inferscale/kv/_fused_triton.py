"""The fused KV write as one Triton kernel, for vLLM's CUDA paged cache (``fused.py``).

One program per (token, layer): read the token's stored key and value rows of that layer (through a
table of row addresses, so the facts' blobs are read where they lie), rotate the key to the token's
position with the layer's cos|sin table (and scale it) and store both in the layer's block layout
``[blocks, heads, block_size, 2 * head_dim]`` (K in the first half of the last dimension, V in the
second), at the token's slot in the layer's group (none: the group keeps no block there, outside a
sliding window; the program stores nothing). Rounding follows one of two rotary kernels, as the
chain rounds with it: ``ROUND_ONCE`` each rotated element computed in fp32 and rounded to bf16 once
(vLLM's CPU kernel), else every product and sum rounded to bf16 (torch's bf16 ops; c10's BFloat16
arithmetic rounds so too). Products of two bf16 values are exact in fp32, so neither depends on
fused multiply-adds. Values reach memory only as bf16 values exactly, so the final casts round
nothing. A token whose rows are codes (``bits`` < 16, ``kv_format.py``) is dequantised as it is
read: value(code) * scale + zero in fp32 (an exact product), rounded to bf16, where an integer
code's value is the integer and an fp8 code's its e4m3 number.
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
def _e4m3(code):
    """The fp32 value of e4m3 (float8_e4m3fn) bytes ``code`` (int32 0..255): bit operations,
    so that the interpreter and every GPU agree; 0x7F and 0xFF are NaN."""
    sign = (code >> 7) & 1
    exponent = (code >> 3) & 15
    mantissa = code & 7
    normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(
        tl.uint32).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa * 2^-9
    value = tl.where(exponent == 0, tl.where(sign == 1, -subnormal, subnormal), normal)
    nan = (code * 0 + 0x7FC00000).to(tl.uint32).to(tl.float32, bitcast=True)
    return tl.where((code & 127) == 127, nan, value)


@triton.jit
def _row(row, heads, d, mask, bits, fp8, params, step, DIM: tl.constexpr):
    """Elements ``d`` of rows ``heads`` (fp32): bf16 rows at ``row``, or b-bit codes there
    (``fp8``: e4m3 bytes) dequantised with (scale, zero) pairs at ``params`` (per head
    ``2 * step``: one pair per element with ``step`` DIM, else one per head)."""
    if bits == 16:
        out = tl.load(row.to(tl.pointer_type(tl.bfloat16)) + heads * DIM + d,
                      mask=mask).to(tl.float32)
    else:
        per = 8 // bits
        codes = row.to(tl.pointer_type(tl.uint8)) + heads * (DIM * bits // 8) + d // per
        code = (tl.load(codes, mask=mask).to(tl.int32) >> ((d % per) * bits)) & (
            (1 << bits) - 1)
        value = code.to(tl.float32)
        if fp8 != 0:
            value = _e4m3(code)
        pair = params + heads * 2 * step + d * (step // DIM)
        scale = tl.load(pair, mask=mask).to(tl.float32)
        zero = tl.load(pair + step, mask=mask).to(tl.float32)
        out = _bf16(value * scale + zero)
    return out


@triton.jit
def inject_kernel(keys, values, layer_strides, bits_of, fp8_of, k_params, v_params,
                  v_params_strides, positions, slots, groups, cos_sin, scales, caches, layer_rows,
                  tokens, block_size,
                  stride_block, stride_head, stride_slot, HEADS: tl.constexpr, DIM: tl.constexpr,
                  ROT: tl.constexpr, HEADS_P2: tl.constexpr, HALF_P2: tl.constexpr,
                  REST_P2: tl.constexpr, DIM_P2: tl.constexpr, SCALED: tl.constexpr,
                  ROUND_ONCE: tl.constexpr):
    token = tl.program_id(0)
    layer = tl.program_id(1)
    bits = tl.load(bits_of + token)
    fp8 = tl.load(fp8_of + token)
    offset = tl.load(layer_strides + token) * layer * tl.where(bits == 16, 2, 1)  # bytes
    key_row = tl.load(keys + token).to(tl.pointer_type(tl.uint8)) + offset
    value_row = tl.load(values + token).to(tl.pointer_type(tl.uint8)) + offset
    key_params = tl.load(k_params + token).to(tl.pointer_type(tl.bfloat16)) + (
        layer * HEADS * 2 * DIM)
    value_params = tl.load(v_params + token).to(tl.pointer_type(tl.bfloat16)) + (
        layer * tl.load(v_params_strides + token))
    table_row = tl.load(layer_rows + layer) + tl.load(positions + token)  # in cos_sin
    slot = tl.load(slots + tl.load(groups + layer) * tokens + token)
    written = tl.where(slot >= 0, HEADS, 0)  # heads to store; -1: a block the group drops
    slot = tl.maximum(slot, 0)
    cache = tl.load(caches + layer).to(tl.pointer_type(tl.bfloat16))
    out = cache + (slot // block_size) * stride_block + (slot % block_size) * stride_slot
    heads = tl.arange(0, HEADS_P2)[:, None]
    present = heads < written
    scale = 1.0
    if SCALED:
        scale = tl.load(scales + layer * tokens + token).to(tl.float32)

    half = ROT // 2
    d = tl.arange(0, HALF_P2)[None, :]
    rotated = present & (d < half)
    x = _row(key_row, heads, d, rotated, bits, fp8, key_params, DIM, DIM)
    y = _row(key_row, heads, d + half, rotated, bits, fp8, key_params, DIM, DIM)
    cos = tl.load(cos_sin + table_row * ROT + d, mask=d < half).to(tl.float32)
    sin = tl.load(cos_sin + table_row * ROT + half + d, mask=d < half).to(tl.float32)
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
        rest = present & (r < DIM)
        kept = _row(key_row, heads, r, rest, bits, fp8, key_params, DIM, DIM)
        if SCALED:
            kept = _bf16(kept * scale)
        tl.store(out + heads * stride_head + r, kept.to(tl.bfloat16), mask=rest)

    v = tl.arange(0, DIM_P2)[None, :]
    row = present & (v < DIM)
    tl.store(out + heads * stride_head + DIM + v,
             _row(value_row, heads, v, row, bits, fp8, value_params, 1, DIM).to(tl.bfloat16),
             mask=row)
