"""KV formats at rest, and the one dequantisation every writer computes.

``raw``: K and V in the model's KV dtype as encoded. ``int8`` / ``int4`` / ``int2``: asymmetric
integer codes (KIVI's split): keys per channel (one scale and zero per layer, head and channel,
over the blob's tokens: pre-RoPE keys have outlier channels, not outlier tokens), values per
token (one per layer, token and head). Codes of b bits sit 8 / b to a byte, element d of a row
in byte ``d * b // 8`` at bit ``(d % (8 // b)) * b``.

The dequantised element is ``code * scale + zero`` in fp32, rounded to the blob's dtype. Scale
and zero are bf16, so the product of a code (at most 8 bits) and a scale is exact in fp32 and
one rounding (the sum) remains, with or without fused multiply-adds: the portable chain
(``dequantized``), the C kernel and the Triton kernel write the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Self

import torch

RAW = "raw"
RAW_BITS = 16  # what the kernels call a raw (bf16) row
FORMATS: dict[str, int] = {RAW: RAW_BITS, "int8": 8, "int4": 4, "int2": 2}
PARAMS_DTYPE = torch.bfloat16


@dataclass(frozen=True, kw_only=True)
class KVPiece:
    """K/V of consecutive tokens of one blob as stored: ``[layers, tokens, heads, head_dim]``
    rows in ``dtype`` (``bits`` 16), or rows of codes ``[layers, tokens, heads, head_dim * bits
    / 8]`` (uint8) with ``k_params [layers, heads, 2, head_dim]`` (scale, zero per channel) and
    ``v_params [layers, tokens, heads, 2]`` (scale, zero per token)."""

    k: torch.Tensor
    v: torch.Tensor
    bits: int = RAW_BITS
    k_params: torch.Tensor | None = None
    v_params: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None  # what codes dequantise to (raw rows: their dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.out_dtype or self.k.dtype

    @property
    def tokens(self) -> int:
        return int(self.k.shape[1])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(layers, tokens, heads, head_dim) of the K (or V) it stands for."""
        layers, tokens, heads, width = self.k.shape
        return layers, tokens, heads, width if self.bits == RAW_BITS else width * 8 // self.bits

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k, self.v, self.k_params, self.v_params)
                   if t is not None)

    def sliced(self, skip: int) -> Self:
        """The piece without its first ``skip`` tokens (views)."""
        if not skip:
            return self
        v_params = None if self.v_params is None else self.v_params[:, skip:]
        return replace(self, k=self.k[:, skip:], v=self.v[:, skip:], v_params=v_params)

    def to(self, device: torch.device, non_blocking: bool = False) -> Self:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(self, k=move(self.k), v=move(self.v), k_params=move(self.k_params),
                       v_params=move(self.v_params))

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V in ``dtype``: the rows themselves where raw (views)."""
        if self.bits == RAW_BITS:
            return self.k, self.v
        assert self.k_params is not None and self.v_params is not None
        dim = self.shape[3]
        kp, vp = self.k_params.float().unsqueeze(1), self.v_params.float()
        k = unpack(self.k, self.bits, dim).float() * kp[..., 0, :] + kp[..., 1, :]
        v = unpack(self.v, self.bits, dim).float() * vp[..., :1] + vp[..., 1:]
        return k.to(self.dtype), v.to(self.dtype)


def bits_of(kv_format: str) -> int:
    if kv_format not in FORMATS:
        raise ValueError(f"unknown KV format {kv_format!r}; known: {', '.join(FORMATS)}")
    return FORMATS[kv_format]


def format_of(bits: int) -> str:
    return next(name for name, b in FORMATS.items() if b == bits)


def unpack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes ``[..., dim * bits / 8]`` (uint8) as integers ``[..., dim]`` (uint8)."""
    per = 8 // bits
    if per == 1:
        return codes
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return ((codes.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)[..., :dim]


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return codes.to(torch.uint8)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    grouped = codes.to(torch.int32).unflatten(-1, (-1, per))
    return (grouped << shifts).sum(-1).to(torch.uint8)


def _params(low: torch.Tensor, high: torch.Tensor, levels: int) -> torch.Tensor:
    """(scale, zero) stacked in the last dimension, bf16: zero the lowest value, scale the step
    that reaches the highest (rounded up a little, so no code exceeds ``levels``)."""
    zero = low.to(PARAMS_DTYPE)
    step = (high - zero.float()).clamp_min(0) / levels
    scale = (step * (1 + 2**-8)).to(PARAMS_DTYPE)
    scale = torch.where(scale.float() > 0, scale, torch.ones_like(scale))
    return torch.stack([scale, zero], dim=-1)


def quantize(k: torch.Tensor, v: torch.Tensor, kv_format: str) -> KVPiece:
    """K and V ``[layers, tokens, heads, head_dim]`` in ``kv_format`` (raw: as they are)."""
    bits = bits_of(kv_format)
    if bits == RAW_BITS:
        return KVPiece(k=k, v=v)
    if k.shape != v.shape or k.dim() != 4 or k.shape[3] % (8 // bits):
        raise ValueError(f"cannot store K/V of shape {tuple(k.shape)} as {kv_format}")
    levels = (1 << bits) - 1
    kf, vf = k.float(), v.float()
    k_params = _params(kf.amin(1), kf.amax(1), levels).transpose(-1, -2).contiguous()
    v_params = _params(vf.amin(-1), vf.amax(-1), levels)

    def codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return _pack(((x - zero.float()) / scale.float()).round().clamp(0, levels), bits)

    kp = k_params.unsqueeze(1)
    return KVPiece(k=codes(kf, kp[..., 0, :], kp[..., 1, :]),
                   v=codes(vf, v_params[..., :1], v_params[..., 1:]), bits=bits,
                   k_params=k_params, v_params=v_params, out_dtype=k.dtype)


PieceLike = KVPiece | tuple[torch.Tensor, torch.Tensor]  # a raw piece may be a (K, V) pair


def as_piece(piece: PieceLike) -> KVPiece:
    return piece if isinstance(piece, KVPiece) else KVPiece(k=piece[0], v=piece[1])
