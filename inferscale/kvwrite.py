"""Fused injection into vLLM's CPU paged cache: one pass instead of three.

The connector's portable path copies the facts' K/V into a staging buffer, rotates the keys in
place with vLLM's rotary kernel and writes each layer with the attention backend's cache
update: three passes over ~52 MB at k = 50 on SmolLM2-135M. ``_kvwrite.c`` reads each stored
row once, rotates and scales it in fp32 exactly as that chain does, and stores it straight into
the block layout of vLLM's CPU attention ("amx" or "vec"), in OpenMP threads over layers (the
same libgomp team as torch's). The connector uses a writer only after it wrote the same bits as
the portable path on a probe (``InferScaleConnector._fused_writer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:
    from inferscale import _kvwrite
except ImportError:  # built without a C compiler: the portable path only
    _kvwrite = None

# vLLM CPU attention's ISA -> the cache layout the kernel writes (its LAYOUT_* constants)
LAYOUTS = {"amx": 0, "vec": 1}


def available() -> bool:
    """Whether the C kernel was built with this install."""
    return _kvwrite is not None


def _pointers(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def _is_kernel_cache(cache: Any) -> bool:
    """Whether ``cache`` is memory the kernel may write as ``[blocks, heads, block_size,
    2 * head_dim]`` bf16: a contiguous 4-d bf16 tensor in host memory."""
    return (isinstance(cache, torch.Tensor) and cache.device.type == "cpu" and cache.dim() == 4
            and cache.dtype == torch.bfloat16 and cache.is_contiguous())


class FusedCpuWriter:
    """Writes ``[layers, tokens, heads, head_dim]`` K/V pieces into the caches of ``layers``
    attention layers (cache ``[blocks, heads, block_size, 2 * head_dim]`` each), rotating the
    keys to their positions with ``cos_sin [positions, rotary_dim]`` and scaling them."""

    def __init__(self, layout: int, cos_sin: torch.Tensor, rotary_dim: int):
        self._layout = layout
        self._cos_sin = cos_sin
        self._rotary_dim = rotary_dim

    @classmethod
    def for_layers(cls, layers: Sequence[tuple[int, Any]], num_layers: int,
                   cos_sin: torch.Tensor, rotary_dim: int) -> FusedCpuWriter | None:
        """A writer for these attention layers (index, layer), or None where the kernel does
        not apply: not built, another ISA, not bf16, a quantised cache, a layer missing."""
        if _kvwrite is None or sorted(index for index, _ in layers) != list(range(num_layers)):
            return None
        isas = {getattr(layer, "isa", None) for _, layer in layers}
        caches = [layer.kv_cache for _, layer in layers]
        if len(isas) != 1 or (isa := isas.pop()) not in LAYOUTS:
            return None
        if not all(_is_kernel_cache(cache) for cache in caches):
            return None
        if any(getattr(layer.impl, "kv_cache_dtype", "auto") != "auto" for _, layer in layers):
            return None
        if cos_sin.dtype != torch.bfloat16 or cos_sin.device.type != "cpu" or (
                cos_sin.dim() != 2 or cos_sin.shape[1] != rotary_dim):
            return None
        return cls(LAYOUTS[isa], cos_sin.contiguous(), rotary_dim)

    def write(self, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]],
              positions: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor | None,
              caches: Sequence[torch.Tensor]) -> None:
        """Write the pieces' tokens, in order, at ``slots`` with keys rotated to ``positions``
        and multiplied by ``scales [layers, tokens]`` (None: unscaled); ``caches[i]`` is layer
        i's. Raises ValueError for anything the kernel cannot take as it is."""
        layers, _, heads, dim = pieces[0][0].shape
        if not all(_is_kernel_cache(cache) for cache in caches):
            raise ValueError("fused KV write: a cache is not contiguous bf16 in host memory")
        blocks, cache_heads, block_size, width = caches[0].shape
        tokens = sum(k.shape[1] for k, _ in pieces)
        if len(caches) != layers or (cache_heads, width) != (heads, 2 * dim) or any(
                c.shape != caches[0].shape for c in caches):
            raise ValueError("fused KV write: caches do not match the pieces")
        for k, v in pieces:
            if v.stride(0) != k.stride(0):
                raise ValueError("fused KV write: a piece's K and V are laid out differently")
            for part in (k, v):
                if (part.shape[0], *part.shape[2:]) != (layers, heads, dim) or (
                        part.dtype != torch.bfloat16 or part.device.type != "cpu"
                        or part.stride()[1:] != (heads * dim, dim, 1)):
                    raise ValueError("fused KV write: a piece is not bf16 rows of the layout")
        if positions.numel() != tokens or slots.numel() != tokens:
            raise ValueError("fused KV write: positions and slots must have one per token")
        if tokens == 0:
            return
        if int(positions.min()) < 0 or int(positions.max()) >= self._cos_sin.shape[0]:
            raise ValueError("fused KV write: a position lies outside the RoPE table")
        if int(slots.min()) < 0 or int(slots.max()) >= blocks * block_size:
            raise ValueError("fused KV write: a slot lies outside the cache")
        counts = torch.tensor([k.shape[1] for k, _ in pieces])
        within = torch.arange(tokens) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        row_bytes = heads * dim * 2

        def rows(which: int) -> torch.Tensor:
            starts = _pointers([piece[which] for piece in pieces])
            return torch.repeat_interleave(starts, counts) + within * row_bytes

        keys, values = rows(0), rows(1)
        strides = torch.repeat_interleave(torch.tensor([k.stride(0) for k, _ in pieces]), counts)
        positions = positions.to(torch.int64).contiguous()
        slots = slots.to(torch.int64).contiguous()
        if scales is not None:
            scales = scales.to(torch.bfloat16).contiguous()
            if scales.shape != (layers, tokens):
                raise ValueError("fused KV write: scales must be [layers, tokens]")
        cache_pointers = _pointers(caches)
        _kvwrite.inject(self._layout, layers, heads, dim, self._rotary_dim, block_size, tokens,
                        keys.data_ptr(), values.data_ptr(), strides.data_ptr(),
                        slots.data_ptr(), positions.data_ptr(), self._cos_sin.data_ptr(),
                        0 if scales is None else scales.data_ptr(), cache_pointers.data_ptr())
