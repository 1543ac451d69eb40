"""The portable injection chain (CPU or CUDA, with or without vLLM): stage, rotate, write.

The facts' K/V pieces are copied once into a staging buffer kept across steps, all keys are
rotated to their serving positions (and scaled) in one call, and each layer's K/V goes to its
paged cache through a cache-update function: vLLM's attention backend's in the connector, a
torch stand-in where vLLM is not installed (``bench inject`` on a GPU box). The CPU path swaps
the whole chain for one fused pass (``fused.py``) where that applies.

On CUDA nothing here waits for the device: the per-token inputs (positions, slots, key scales)
are built on the host and go over in non-blocking copies from pinned memory, and no value is
read back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from inferscale.contracts.kv_format import PieceLike, as_piece
from inferscale.kv.rope import ChunkedRope

# (layer index, keys [tokens, heads, head_dim], values, slots [tokens]) -> None
CacheUpdate = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]
SKIP = -1  # a token's slot in a layer that keeps no KV for it (outside a sliding window)


@dataclass(frozen=True)
class LayerSlots:
    """Each token's slot in each layer's paged cache: ``table[groups[layer], token]``. vLLM's
    hybrid KV cache manager gives each group of layers its own block table, so one position
    has a slot per group; ``SKIP`` where the group keeps no block for it (positions a sliding
    window no longer sees). Built on the host."""

    table: torch.Tensor  # [groups, tokens] int64
    groups: torch.Tensor  # [layers] int64: each layer's row of ``table``

    @classmethod
    def of(cls, slots: torch.Tensor | LayerSlots, layers: int) -> LayerSlots:
        """``slots`` as it is, or one slot per token for every one of ``layers`` layers."""
        if isinstance(slots, LayerSlots):
            return slots
        return cls(slots.reshape(1, -1), torch.zeros(layers, dtype=torch.int64))

    @property
    def tokens(self) -> int:
        return int(self.table.shape[1])

    def written(self) -> list[torch.Tensor | None]:
        """Per group, the tokens it writes (indices), or None where it writes every one."""
        kept = self.table != SKIP
        return [None if bool(row.all()) else row.nonzero().squeeze(1) for row in kept]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; a host tensor goes to a GPU in a non-blocking copy from pinned
    memory (a copy from pageable memory waits for the device's stream)."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class ChainWriter:
    """Writes ``[layers, tokens, heads, head_dim]`` K/V pieces with ``rope``'s rotation."""

    def __init__(self, rope: ChunkedRope):
        self.rope = rope
        self._staging: torch.Tensor | None = None

    def staged(self, tokens: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K and V ``[layers, tokens, heads, head_dim]`` in one buffer kept across
        steps and grown as needed: a fresh ~50 MB buffer per step (k = 50, SmolLM2) is,
        whenever the allocator has handed the last one back to the OS, ~50 MB of page faults
        (a CPU step then took 29 ms instead of 17)."""
        shape = (like.shape[0], tokens, *like.shape[2:])
        size = 2 * math.prod(shape)
        staging = self._staging
        if staging is None or staging.numel() < size or (staging.dtype, staging.device) != (
                like.dtype, like.device):
            staging = self._staging = like.new_empty(size)
        both = staging[:size].view(2, *shape)
        return both[0], both[1]

    def release(self) -> None:
        """Give the staging buffer back (it is made again at the next write)."""
        self._staging = None

    def write(self, pieces: Sequence[PieceLike], positions: torch.Tensor,
              slots: torch.Tensor | LayerSlots, scales: torch.Tensor | None,
              update: CacheUpdate) -> dict[str, float]:
        """Write the pieces' tokens, in order, at ``slots`` (one per token for every layer, or
        ``LayerSlots``; on the host), keys rotated to ``positions`` and multiplied by
        ``scales [layers, tokens]`` (None: unscaled); coded pieces are dequantised first.
        Positions and scales may live on the host. Returns the seconds each stage took on the
        host (on CUDA: to launch it)."""
        started = time.perf_counter()
        rows = [as_piece(piece).dequantized() for piece in pieces]
        device = rows[0][0].device
        layer_slots = LayerSlots.of(slots, rows[0][0].shape[0])
        written = [None if kept is None else to_device(kept, device)
                   for kept in layer_slots.written()]
        table = to_device(layer_slots.table, device)
        positions = to_device(positions, device)
        scales = None if scales is None else to_device(scales, device)
        k, v = self.staged(sum(row[0].shape[1] for row in rows), rows[0][0])
        torch.cat([row[0] for row in rows], dim=1, out=k)
        torch.cat([row[1] for row in rows], dim=1, out=v)
        gathered = time.perf_counter()
        self.rope.rotate_(k, positions, scales)
        rotated = time.perf_counter()
        for layer, group in enumerate(layer_slots.groups.tolist()):
            kept = written[group]
            if kept is None:
                update(layer, k[layer], v[layer], table[group])
            elif kept.numel():
                update(layer, k[layer, kept], v[layer, kept], table[group, kept])
        return {"gather": gathered - started, "rope": rotated - gathered,
                "cache_write": time.perf_counter() - rotated}
