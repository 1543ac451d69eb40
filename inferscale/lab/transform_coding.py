"""Transform-coded KV at rest (issue #71, a lab study not yet wired to the store): a basis per
layer and head fitted once per model, no parameters in a blob.

A *profile* holds, per layer, KV head and kind (keys, values), the mean and the principal axes
of the model's pre-RoPE K (or V) rows over calibration facts, the axes ordered by variance. A row
``x`` (``head_dim`` values) becomes coefficients ``(x - mean) @ axes``; two coders spend bits on
them:

- ``FixedRateCoder`` (``fr<bits>``): each coefficient gets a width of 0, 1, 2, 4 or 8 bits by
  reverse water-filling over the profile's variances (KVTC's allocation by component variance),
  averaging ``mean_bits`` over all coefficients, and a uniform midrise quantiser with the step
  that is optimal for a Gaussian of its variance; codes are packed by width, a coefficient of 0
  bits is not stored. Decoding is an unpack, a multiply and one batched matmul.
- ``encode`` / ``decode`` (``tc<quality>``): one uniform step for every coefficient of a (layer,
  head, kind), ``quality`` root mean variances (with an entropy coder a uniform step is the
  allocation that minimises squared error), codes laid out component-major and compressed with
  zstd, behind a small versioned header. zstd's Huffman stage cannot spend under a bit on a
  symbol, so near-empty components cost more than their entropy (measured in
  ``docs/results/cost.md``).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import zstandard
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from inferscale.contracts.kv_format import pack, unpack

MAGIC = b"ISTC"
VERSION = 1
HEADER = struct.Struct("<4sBBHIHHf")  # magic, version, code bytes, layers, tokens, heads, dim, q
ZSTD_LEVEL = 3
MAX_TOKENS = 1 << 20
KINDS = ("k", "v")


class TransformCodingError(ValueError):
    """A profile or coded blob that cannot be used."""


@dataclass(frozen=True)
class TransformProfile:
    """Per kind: ``mean [layers, heads, dim]``, ``axes [layers, heads, dim, dim]`` (columns:
    principal axes, by variance descending), ``variance [layers, heads, dim]`` (along each
    axis). ``model``: the fingerprint of the model it was fitted on."""

    mean: dict[str, torch.Tensor]
    axes: dict[str, torch.Tensor]
    variance: dict[str, torch.Tensor]
    model: str

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, heads, head_dim)."""
        layers, heads, dim = self.mean["k"].shape
        return layers, heads, dim

    @functools.cached_property
    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Means ``[2, layers, heads, dim]`` and axes ``[2, layers, heads, dim, dim]``, K first."""
        return (torch.stack([self.mean[kind] for kind in KINDS]),
                torch.stack([self.axes[kind] for kind in KINDS]))

    def coefficients(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """K and V ``[layers, tokens, heads, dim]`` as coefficients of the axes: ``[2, layers,
        heads, tokens, dim]``, K first."""
        if v.shape != k.shape or k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != self.shape:
            raise TransformCodingError(f"K/V of shape {tuple(k.shape)} do not fit a profile of "
                                       f"(layers, heads, dim) {self.shape}")
        mean, axes = self._stacked
        return (torch.stack([k.float(), v.float()]).transpose(2, 3) - mean.unsqueeze(3)) @ axes

    def rows(self, coefficients: torch.Tensor, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``coefficients``' inverse: K and V ``[layers, tokens, heads, dim]`` in ``dtype``."""
        mean, axes = self._stacked
        k, v = (coefficients @ axes.transpose(-1, -2) + mean.unsqueeze(3)).transpose(2, 3).to(dtype)
        return k.contiguous(), v.contiguous()

    def steps(self, quality: float) -> torch.Tensor:
        """The quantisation step of each (kind, layer, head): ``[2, layers, heads]``."""
        return torch.stack([self.variance[kind].mean(-1).sqrt() for kind in KINDS]) * quality

    def save(self, path: Path) -> None:
        tensors = {f"{part}.{kind}": getattr(self, part)[kind].contiguous()
                   for part in ("mean", "axes", "variance") for kind in KINDS}
        save_file(tensors, str(path), metadata={"model": self.model, "version": str(VERSION)})

    @classmethod
    def load(cls, path: Path) -> TransformProfile:
        try:
            with safe_open(str(path), "pt") as handle:
                model = (handle.metadata() or {}).get("model", "")
            tensors = load_file(str(path))
            parts = {part: {kind: tensors[f"{part}.{kind}"].float() for kind in KINDS}
                     for part in ("mean", "axes", "variance")}
        except (OSError, KeyError, ValueError, RuntimeError, SafetensorError) as exc:
            raise TransformCodingError(f"{path}: not a transform profile ({exc})") from None
        profile = cls(parts["mean"], parts["axes"], parts["variance"], model)
        layers, heads, dim = profile.shape
        for kind in KINDS:
            if (profile.axes[kind].shape != (layers, heads, dim, dim)
                    or profile.mean[kind].shape != (layers, heads, dim)
                    or profile.variance[kind].shape != (layers, heads, dim)
                    or not all(t.isfinite().all() for t in (profile.axes[kind],
                                                            profile.mean[kind],
                                                            profile.variance[kind]))):
                raise TransformCodingError(f"{path}: inconsistent transform profile")
        return profile


class ProfileFit:
    """Running sums of K/V rows per (layer, head) in float64, for ``profile``."""

    def __init__(self) -> None:
        self.count = 0
        self.sums: dict[str, torch.Tensor] = {}
        self.products: dict[str, torch.Tensor] = {}

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows of one fact: ``[layers, tokens, heads, dim]`` each."""
        for kind, x in zip(KINDS, (k, v), strict=True):
            rows = x.double().permute(0, 2, 1, 3)  # [layers, heads, tokens, dim]
            total = rows.sum(2)
            product = rows.transpose(-1, -2) @ rows
            if kind in self.sums:
                self.sums[kind] += total
                self.products[kind] += product
            else:
                self.sums[kind], self.products[kind] = total, product
        self.count += int(k.shape[1])

    def profile(self, model: str) -> TransformProfile:
        if self.count < 2:
            raise TransformCodingError("a profile needs K/V rows of at least two tokens")
        mean, axes, variance = {}, {}, {}
        for kind in KINDS:
            m = self.sums[kind] / self.count
            covariance = self.products[kind] / self.count - m.unsqueeze(-1) * m.unsqueeze(-2)
            values, vectors = torch.linalg.eigh(covariance)  # ascending
            mean[kind] = m.float()
            axes[kind] = vectors.flip(-1).float().contiguous()
            variance[kind] = values.flip(-1).clamp_min(0).float().contiguous()
        return TransformProfile(mean, axes, variance, model)


def encode(k: torch.Tensor, v: torch.Tensor, profile: TransformProfile, quality: float) -> bytes:
    """K and V ``[layers, tokens, heads, dim]`` coded at ``quality`` (a step of ``quality``
    root mean variances)."""
    coefficients = profile.coefficients(k, v)  # refuses K/V of another shape
    layers, tokens, heads, dim = k.shape
    if not 0 < quality < 1e3 or tokens > MAX_TOKENS:
        raise TransformCodingError(f"cannot code {tokens} tokens at quality {quality}")
    codes = (coefficients / profile.steps(quality)[..., None, None]).round()
    codes = codes.transpose(-1, -2)  # [kind, layers, heads, component, token]
    wide = bool(codes.abs().max() > 127) if codes.numel() else False
    if wide and codes.abs().max() > 32767:
        raise TransformCodingError(f"quality {quality} is too fine for these K/V")
    raw = codes.to(torch.int16 if wide else torch.int8).contiguous().numpy().tobytes()
    header = HEADER.pack(MAGIC, VERSION, 2 if wide else 1, layers, tokens, heads, dim, quality)
    return header + zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)


def decode(data: bytes, profile: TransformProfile, dtype: torch.dtype = torch.bfloat16
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V ``[layers, tokens, heads, dim]`` in ``dtype`` that ``encode`` coded."""
    if len(data) < HEADER.size:
        raise TransformCodingError("a transform-coded blob shorter than its header")
    magic, version, width, layers, tokens, heads, dim, quality = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or width not in (1, 2):
        raise TransformCodingError("not a transform-coded blob of a version this reader knows")
    if (layers, heads, dim) != profile.shape or tokens > MAX_TOKENS or not 0 < quality < 1e3:
        raise TransformCodingError(f"a blob of (layers, heads, dim) {(layers, heads, dim)}, "
                                   f"{tokens} tokens, does not fit the profile {profile.shape}")
    size = 2 * layers * heads * dim * tokens * width
    frame = data[HEADER.size:]
    try:  # the frame says its size (``encode`` writes it): checked before anything is made
        if zstandard.frame_content_size(frame) != size:
            raise TransformCodingError("transform-coded blob: codes of the wrong length")
        raw = zstandard.ZstdDecompressor().decompress(frame)
    except zstandard.ZstdError as exc:
        raise TransformCodingError(f"transform-coded blob: {exc}") from None
    if len(raw) != size:
        raise TransformCodingError("transform-coded blob: codes of the wrong length")
    codes = torch.frombuffer(bytearray(raw), dtype=torch.int16 if width == 2 else torch.int8)
    codes = codes.view(2, layers, heads, dim, tokens).float()
    coefficients = codes.transpose(-1, -2) * profile.steps(quality)[..., None, None]
    return profile.rows(coefficients, dtype)


# Uniform midrise quantiser steps, in standard deviations, that minimise a Gaussian's squared
# error at each width (Max 1960); the widths codes pack into whole bytes.
GAUSSIAN_STEP = {1: 1.596, 2: 0.996, 4: 0.335, 8: 0.031}
WIDTH_EDGES = torch.tensor([0.5, 1.5, 3.0, 6.0])  # a continuous allocation -> 0, 1, 2, 4, 8
WIDTHS = torch.tensor([0.0, 1.0, 2.0, 4.0, 8.0])


def allocate(variance: torch.Tensor, mean_bits: float) -> torch.Tensor:
    """Bits per coefficient (0, 1, 2, 4 or 8), by reverse water-filling: ``log2(variance /
    theta) / 2`` rounded to a width, with theta the level whose widths average ``mean_bits`` at
    most."""
    log_variance = variance.double().clamp_min(1e-20).log2()

    def widths(theta: float) -> torch.Tensor:
        wanted = (0.5 * (log_variance - theta)).clamp(0, 8)
        return WIDTHS.double()[torch.bucketize(wanted, WIDTH_EDGES.double(), right=True)]

    low, high = float(log_variance.min()) - 20, float(log_variance.max()) + 1
    for _ in range(60):  # widths fall as theta rises
        middle = (low + high) / 2
        low, high = (middle, high) if widths(middle).mean() > mean_bits else (low, middle)
    return widths(high).float()


class FixedRateCoder:
    """K/V as coefficients of the profile's axes at fixed widths (``allocate``): ``encode`` gives
    one packed code array per width ``[tokens, coefficients of that width]``."""

    def __init__(self, profile: TransformProfile, mean_bits: float):
        if not 0 < mean_bits <= 8:
            raise TransformCodingError(f"mean bits {mean_bits} not in (0, 8]")
        self.profile = profile
        variance = torch.stack([profile.variance[kind] for kind in KINDS])
        self.widths = allocate(variance, mean_bits)
        flat = self.widths.flatten()
        self.groups = {int(w): (flat == w).nonzero().flatten() for w in GAUSSIAN_STEP
                       if bool((flat == w).any())}
        self.steps = torch.zeros_like(flat)
        for width, index in self.groups.items():
            self.steps[index] = GAUSSIAN_STEP[width] * variance.flatten()[index].sqrt()

    @property
    def mean_bits(self) -> float:
        return float(self.widths.mean())

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[int, torch.Tensor]:
        """K and V ``[layers, tokens, heads, dim]`` as packed codes by width."""
        coefficients = self.profile.coefficients(k, v).permute(3, 0, 1, 2, 4)
        flat = coefficients.flatten(1)  # [T, 2 * L * H * D]
        coded = {}
        for width, index in self.groups.items():
            levels = 1 << width
            codes = (flat[:, index] / self.steps[index] + levels / 2 - 0.5).round()
            codes = torch.nn.functional.pad(codes.clamp(0, levels - 1),
                                            (0, -len(index) % (8 // width)))
            coded[width] = pack(codes, width)
        return coded

    def decode(self, coded: dict[int, torch.Tensor], tokens: int,
               dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V that ``encode`` coded."""
        flat = torch.zeros(tokens, self.widths.numel())
        for width, index in self.groups.items():
            codes = unpack(coded[width], width, len(index) + -len(index) % (8 // width))
            values = codes[:, :len(index)].float() - (1 << width) / 2 + 0.5
            flat[:, index] = values * self.steps[index]
        coefficients = flat.view(tokens, *self.widths.shape).permute(1, 2, 3, 0, 4)
        return self.profile.rows(coefficients, dtype)

    @staticmethod
    def nbytes(coded: dict[int, torch.Tensor]) -> int:
        return sum(codes.nbytes for codes in coded.values())
