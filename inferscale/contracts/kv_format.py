"""KV formats at rest, and the one dequantisation every writer computes.

``raw``: K and V in the model's KV dtype as encoded. ``int8`` / ``int4`` / ``int2``: asymmetric
integer codes (KIVI's split): keys per channel (one scale and zero per layer, head and channel,
over the blob's tokens: pre-RoPE keys have outlier channels, not outlier tokens), values per
token (one per layer, token and head). Codes of b bits sit 8 / b to a byte, element d of a row
in byte ``d * b // 8`` at bit ``(d % (8 // b)) * b``. ``fp8``: one fp8 e4m3 (``float8_e4m3fn``)
byte an element, with the same params: the zero is the middle of the range, and the scale maps
its half-width to e4m3's largest finite value, 448 (codes 0x7F and 0xFF, NaN, are never
written).

The dequantised element is ``value(code) * scale + zero`` in fp32, rounded to the blob's dtype;
an integer code's value is the integer, an e4m3 code's the fp8 number. Scale and zero are bf16,
so the product of a value (at most 8 significant bits) and a scale is exact in fp32 and one
rounding (the sum) remains, with or without fused multiply-adds: the portable chain
(``dequantized``), the C kernel and the Triton kernel write the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Self

import torch

RAW = "raw"
RAW_BITS = 16  # what the kernels call a raw (bf16) row
FP8 = "fp8"
FORMATS: dict[str, int] = {RAW: RAW_BITS, "int8": 8, "int4": 4, "int2": 2, FP8: 8}  # bits
FP8_MAX = 448.0  # e4m3's largest finite value
PARAMS_DTYPE = torch.bfloat16


@dataclass(frozen=True, kw_only=True)
class KVPiece:
    """K/V of consecutive tokens of one blob as stored: ``[layers, tokens, heads, head_dim]``
    rows in ``dtype`` (``kv_format`` raw), or rows of codes ``[layers, tokens, heads, head_dim *
    bits / 8]`` (uint8) with ``k_params [layers, heads, 2, head_dim]`` (scale, zero per channel)
    and ``v_params [layers, tokens, heads, 2]`` (scale, zero per token)."""

    k: torch.Tensor
    v: torch.Tensor
    kv_format: str = RAW
    k_params: torch.Tensor | None = None
    v_params: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None  # what codes dequantise to (raw rows: their dtype)

    @property
    def bits(self) -> int:
        return FORMATS[self.kv_format]

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
        kp, vp = self.k_params.float().unsqueeze(1), self.v_params.float()
        k = self._values(self.k) * kp[..., 0, :] + kp[..., 1, :]
        v = self._values(self.v) * vp[..., :1] + vp[..., 1:]
        return k.to(self.dtype), v.to(self.dtype)

    def _values(self, codes: torch.Tensor) -> torch.Tensor:
        """The values of ``codes`` (fp32), one a row element."""
        if self.kv_format == FP8:
            return codes.view(torch.float8_e4m3fn).float()
        return unpack(codes, self.bits, self.shape[3]).float()


def bits_of(kv_format: str) -> int:
    if kv_format not in FORMATS:
        raise ValueError(f"unknown KV format {kv_format!r}; known: {', '.join(FORMATS)}")
    return FORMATS[kv_format]


def unpack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes ``[..., dim * bits / 8]`` (uint8) as integers ``[..., dim]`` (uint8)."""
    per = 8 // bits
    if per == 1:
        return codes
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return ((codes.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)[..., :dim]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers ``[..., dim]`` of ``bits`` each as packed codes ``[..., dim * bits / 8]`` (``dim``
    a multiple of ``8 / bits``): ``unpack``'s inverse."""
    per = 8 // bits
    if per == 1:
        return codes.to(torch.uint8)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    grouped = codes.to(torch.int32).unflatten(-1, (-1, per))
    return (grouped << shifts).sum(-1).to(torch.uint8)


def _params(low: torch.Tensor, high: torch.Tensor, kv_format: str) -> torch.Tensor:
    """(scale, zero) stacked in the last dimension, bf16, rounded up a little so that no code
    leaves its range. Integer codes: zero the lowest value, scale the step that reaches the
    highest. fp8: zero the middle, scale the half-width over ``FP8_MAX``."""
    if kv_format == FP8:
        zero = ((low + high) / 2).to(PARAMS_DTYPE)
        step = torch.maximum(high - zero.float(), zero.float() - low) / FP8_MAX
    else:
        zero = low.to(PARAMS_DTYPE)
        step = (high - zero.float()).clamp_min(0) / ((1 << FORMATS[kv_format]) - 1)
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
    kf, vf = k.float(), v.float()
    k_params = _params(kf.amin(1), kf.amax(1), kv_format).transpose(-1, -2).contiguous()
    v_params = _params(vf.amin(-1), vf.amax(-1), kv_format)

    def codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        scaled = (x - zero.float()) / scale.float()
        if kv_format == FP8:
            return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return pack(scaled.round().clamp(0, (1 << bits) - 1), bits)

    kp = k_params.unsqueeze(1)
    return KVPiece(k=codes(kf, kp[..., 0, :], kp[..., 1, :]),
                   v=codes(vf, v_params[..., :1], v_params[..., 1:]), kv_format=kv_format,
                   k_params=k_params, v_params=v_params, out_dtype=k.dtype)


PieceLike = KVPiece | tuple[torch.Tensor, torch.Tensor]  # a raw piece may be a (K, V) pair


def as_piece(piece: PieceLike) -> KVPiece:
    return piece if isinstance(piece, KVPiece) else KVPiece(k=piece[0], v=piece[1])
