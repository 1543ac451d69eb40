"""The connector's worker half, in vLLM's Worker process: page the claimed KV in and write it.

For each step's loads it pages the segments' blobs in by id (device -> host -> durable,
``kv/store.py``), checks them against the plan and the serving model's layout, rotates every
key to its serving position (Chunked RoPE), scales the facts' keys where the plan asks
(``kv/key_scales.py``) and writes K/V into the request's paged blocks: in one fused pass where
a fused writer passed its probe (``kv/fused.py``), else with the portable chain
(``kv/chain.py``: vLLM's rotary kernel and the attention backend's cache update). A blob that
is missing, corrupt, made for another model or does not match the prompt fails only its
request's blocks (its request, where loads are asynchronous), which vLLM recomputes. Under vLLM's
hybrid KV cache manager each group of layers has its own blocks, so each token has a slot per
group (``chain.LayerSlots``), and a sliding-window group's blocks before its window are vLLM's
null block: those rows are not written.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from inferscale.contracts.blob_name import PREAMBLE, BlobName
from inferscale.contracts.kv_format import KVPiece, PieceLike
from inferscale.kv.chain import SKIP, ChainWriter, LayerSlots
from inferscale.kv.fused import FusedCpuWriter, FusedTritonWriter, first_exact, fused_writers
from inferscale.kv.key_scales import KeyScales, key_factor
from inferscale.kv.kv_metrics import KV_METRICS
from inferscale.kv.rope import ChunkedRope
from inferscale.kv.store import KVStore
from inferscale.serving.connector_scheduler import LoadSpec

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("inferscale.serving.connector")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")
NULL_BLOCK = 0  # vLLM's null block: the id a group's table holds where it keeps no block
_UNDECIDED = object()
Piece = tuple[KVPiece, BlobName]  # K/V as stored (raw rows or codes), its segment's blob


class ConnectorWorker:
    """Writes the claimed KV into vLLM's paged cache; one per vLLM worker."""

    def __init__(self, store: KVStore, rope: ChunkedRope, dtype: torch.dtype,
                 kv_shape: tuple[int, int, int], block_size: int,
                 key_scales: KeyScales | None, layer_groups: list[int] | None = None) -> None:
        """``kv_shape``: (layers, kv heads, head dim) of the served model, whose KV dtype is
        ``dtype``; ``key_scales``: the fitted scales for the served model, if any;
        ``layer_groups``: each layer's KV cache group (None: one group)."""
        self.store = store
        self.rope = rope
        self.dtype = dtype
        self.kv_shape = kv_shape
        self.block_size = block_size
        self.key_scales = key_scales
        self.layer_groups = torch.tensor(layer_groups or [0] * kv_shape[0], dtype=torch.int64)
        if self.layer_groups.shape != (kv_shape[0],):
            raise ValueError(f"{len(self.layer_groups)} layers in KV cache groups, "
                             f"not the model's {kv_shape[0]}")
        self._chain = ChainWriter(rope)
        self._writer: Any = _UNDECIDED  # a fused writer or None, once the layers are known
        self._layers: list[tuple[int, Any]] | None = None
        self._failed_blocks: set[int] = set()
        self._received: set[str] = set()  # asynchronous loads done or failed since last asked
        self._failed_requests: set[str] = set()  # ... of which failed

    def load(self, loads: list[LoadSpec], forward_context: ForwardContext) -> None:
        """Page in every load's KV and write it, keys rotated to their positions (and the
        facts' keys scaled where the plan asks): with the fused writer where one applies, else
        with the portable chain. Positions, slots and scales are built on the host; the chain
        moves them to the device without waiting for it."""
        started = time.perf_counter()
        pieces: list[KVPiece] = []
        positions, slots = [], []
        runs: list[tuple[torch.Tensor | None, int]] = []  # per piece: its key scales, tokens
        for spec in loads:
            try:
                spec_pieces = self._pieces(spec)
                spec_positions = torch.arange(spec.start, spec.end)
                spec_slots = self._slots(spec, spec_positions)
            except Exception as exc:  # noqa: BLE001 - any bad blob or spec: recompute it
                log.warning("request %s: falling back to prefill: %s", spec.request_id, exc)
                KV_METRICS.load_failures.labels(getattr(exc, "reason", "mismatch")).inc()
                self.fail([spec])
                continue
            pieces += [piece for piece, _ in spec_pieces]
            positions.append(spec_positions)
            slots.append(spec_slots)
            runs += self._scale_runs(spec, spec_pieces)
            if spec.asynchronous:  # failed after this only by an exception, failing them all
                self._received.add(spec.request_id)
        if not pieces:
            return
        layers = self._attention_layers(forward_context)
        scaled = any(run_scales is not None for run_scales, _ in runs)
        scales = key_factor(runs, self.kv_shape[0], dtype=pieces[0].dtype) if scaled else None
        slot_mapping = LayerSlots(torch.cat(slots, dim=1), self.layer_groups)
        all_positions = torch.cat(positions)
        skipped = (slot_mapping.table == SKIP).sum(1)
        KV_METRICS.window_skipped_rows.inc(int(skipped[self.layer_groups].sum()))
        writer = self.fused_writer(layers)
        paged_in = time.perf_counter()
        if writer is None:
            stages = self._chain.write(pieces, all_positions, slot_mapping, scales,
                                       _cache_update(layers))
            stages["gather"] += paged_in - started
        else:
            writer.write(pieces, all_positions, slot_mapping, scales,
                         [layer.kv_cache for _, layer in sorted(layers, key=lambda p: p[0])])
            stages = {"gather": paged_in - started, "fused_write": time.perf_counter() - paged_in}
        for stage, seconds in stages.items():
            KV_METRICS.stage_seconds.labels(stage).observe(seconds)
        KV_METRICS.injected_tokens.inc(len(all_positions))

    def fail(self, loads: list[LoadSpec]) -> None:
        """Report these loads failed (vLLM recomputes them): per request where asynchronous,
        else every block."""
        for spec in loads:
            if spec.asynchronous:
                self._received.add(spec.request_id)
                self._failed_requests.add(spec.request_id)
            else:
                self._failed_blocks |= self._blocks_of(spec)

    def take_failed_blocks(self) -> set[int]:
        """vLLM's ``get_block_ids_with_load_errors``: the failed blocks since the last call."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """The asynchronous loads done or failed since the last call, and those that failed
        (vLLM's ``finished_recving`` and ``failed_recving``)."""
        received, failed = self._received, self._failed_requests
        self._received, self._failed_requests = set(), set()
        return received, failed

    def purge(self, locations: list[str]) -> int:
        """Drop blobs from this worker's memory tiers (a forget or an update elsewhere)."""
        return self.store.evict(locations)

    def memory_tiers(self, locations: list[str]) -> list[list[str]]:
        """For each blob, this worker's memory tiers that hold it."""
        return self.store.memory_tiers(locations)

    def fused_writer(self, layers: list[tuple[int, Any]]
                     ) -> FusedCpuWriter | FusedTritonWriter | None:
        """The fused writer for these layers, decided once: the first whose kernel applies and,
        on a probe, writes exactly what the portable chain writes (``fused.first_exact``)."""
        if self._writer is _UNDECIDED:
            def chain(pieces: list[PieceLike], positions: torch.Tensor,
                      slots: LayerSlots, scales: torch.Tensor | None,
                      caches: list[torch.Tensor]) -> None:
                self._chain.write(pieces, positions, slots, scales, _cache_update(layers, caches))
                self._chain.release()

            self._writer = first_exact(
                fused_writers(layers, self.kv_shape[0], self.rope),
                chain, self.kv_shape, self.block_size)
            log.info("KV writes: %s", self._writer.name if self._writer else "vLLM's ops")
        return self._writer

    def _scale_runs(self, spec: LoadSpec, pieces: list[Piece]
                    ) -> list[tuple[torch.Tensor | None, int]]:
        """(key scales or None, tokens) per piece: the facts' pieces of a plan that asks for
        key scales take the scales for the plan's number of injected facts, raised to the
        plan's strength."""
        scales = None
        if spec.key_scales > 0 and self.key_scales is not None:
            scales = self.key_scales.for_facts(
                sum(segment.name != PREAMBLE for segment in spec.segments)) ** spec.key_scales
        return [(None if name == PREAMBLE else scales, piece.tokens) for piece, name in pieces]

    def _pieces(self, spec: LoadSpec) -> list[Piece]:
        """Views of the segments' blobs covering positions [start, end), checked against the
        plan and the serving layout."""
        pieces = []
        segments = [segment for segment in spec.segments if segment.end > spec.start]
        blobs = self.store.load_many([s.name for s in segments],  # misses concurrently
                                     [s.checksum for s in segments])
        for segment, blob in zip(segments, blobs, strict=True):
            if not segment.matches(blob.token_ids):
                raise ValueError(f"blob {segment.name} does not match the prompt tokens")
            if blob.dtype != self.dtype or (blob.shape[0], *blob.shape[2:]) != self.kv_shape:
                raise ValueError(f"blob {segment.name} is {blob.dtype} {blob.shape},"
                                 f" not the serving model's layout")
            pieces.append((blob.piece(max(0, spec.start - segment.start)), segment.name))
        if sum(piece.tokens for piece, _ in pieces) != spec.end - spec.start:
            raise ValueError("the plan's segments do not cover the claimed positions")
        return pieces

    def _slots(self, spec: LoadSpec, positions: torch.Tensor) -> torch.Tensor:
        """``[groups, tokens]``: each position's slot in each group's blocks (``SKIP`` in
        the null block)."""
        groups = int(self.layer_groups.max()) + 1
        if len(spec.block_ids) != groups:
            raise ValueError(f"{len(spec.block_ids)} block tables for {groups} KV cache groups")
        rows = []
        for group_blocks in spec.block_ids:
            blocks = torch.tensor(group_blocks, dtype=torch.int64)[positions // self.block_size]
            rows.append(torch.where(blocks == NULL_BLOCK, SKIP, blocks * self.block_size + (
                positions % self.block_size)))
        return torch.stack(rows)

    def _blocks_of(self, spec: LoadSpec) -> set[int]:
        """The blocks of a synchronous load's positions (the null block is no one's)."""
        first, last = spec.start // self.block_size, (spec.end - 1) // self.block_size
        return {block for group_blocks in spec.block_ids
                for block in group_blocks[first:last + 1]} - {NULL_BLOCK}

    def _attention_layers(self, forward_context: ForwardContext) -> list[tuple[int, Any]]:
        """(layer index, attention layer) pairs; the set is static, so it is found once."""
        if self._layers is None:
            layers = []
            for name, layer in forward_context.no_compile_layers.items():
                match = _LAYER_INDEX.search(name)
                if getattr(layer, "kv_cache", None) is not None and hasattr(layer, "impl") and (
                        match is not None):
                    layers.append((int(match.group(1)), layer))
            self._layers = layers
        return self._layers


def layer_groups(kv_cache_config: KVCacheConfig | None, layers: int) -> list[int] | None:
    """Each layer's KV cache group, by the index in its name (None: one group)."""
    if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) <= 1:
        return None
    groups: dict[int, int] = {}
    for group, spec in enumerate(kv_cache_config.kv_cache_groups):
        for name in spec.layer_names:
            if (match := _LAYER_INDEX.search(name)) is not None:
                groups[int(match.group(1))] = group
    if sorted(groups) != list(range(layers)):
        raise ValueError(f"KV cache groups cover layers {sorted(groups)}, not 0..{layers - 1}")
    return [groups[layer] for layer in range(layers)]


def _cache_update(layers: list[tuple[int, Any]], caches: list[torch.Tensor] | None = None
                  ) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """Layer i's K/V written with its attention backend's cache update, into ``caches[i]``
    (else the layer's own cache)."""
    by_index = dict(layers)

    def update(index: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        layer = by_index[index]
        layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache if caches is None
                                      else caches[index], slots)

    return update
