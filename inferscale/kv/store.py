"""Tiered store of per-fact KV blobs: durable tier -> host-RAM LRU -> device hot cache.

Blobs are named by ``inferscale.contracts.blob_name`` (a fact's, its lead encoding's: its KV encoded
after the preamble alone, stored next to it; or the preamble's) and encoded by
``inferscale.contracts.blob``; callers use names (``exists``, ``put``, ``load``) or the locations
recorded in Postgres (``get``, ``get_many``), never paths. Evicting or deleting a fact's blob takes
its lead blob with it. The durable tier (``inferscale.kv.durable``: a directory or a bucket) makes
writes atomic; checksum and fingerprint are verified when a blob is paged in from it, except that a
store hashes a file's content once per version of the file (``file_version``: identity, size and
change times; a bucket's objects are hashed at every read). A blob may be rewritten under its name
(a fact encoded again): a memory tier serves its copy only to a reader that expects that copy's
checksum (or none), others page the new blob in.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from cachetools import LRUCache

from inferscale.contracts.blob import KVBlob, decode_blob, encode_blob
from inferscale.contracts.blob_name import BlobName, FactId, parse_location, with_leads
from inferscale.contracts.kv_format import RAW
from inferscale.core.procs import run_on_process_cpus
from inferscale.kv.durable import BlobMissing, Durable, KVBlobError, Read, open_durable
from inferscale.kv.host_arena import HostArena, pinned_buffer
from inferscale.kv.kv_metrics import KV_METRICS

if TYPE_CHECKING:
    from inferscale.core.settings import Settings

__all__ = ["BlobMissing", "ByteLRU", "ChecksumMismatch", "FingerprintMismatch", "KVBlobError",
           "KVStore", "StoredBlob"]
# The smallest page-in arena: a store with little or no host tier still pages blobs in for the
# requests in flight, and those buffers are reused instead of faulted in afresh every time
# (mapped only once a page-in needs it).
PAGE_IN_ARENA_MIN = 256 << 20
VERIFIED_VERSIONS = 1 << 16  # blob versions remembered as hashed: ~64 GB of KV at 1 MB a blob


def _finished(call: Callable[..., KVBlob], *args: Any) -> Future[KVBlob]:
    """``call(*args)`` run here, as a finished future (its result, or its error)."""
    done: Future[KVBlob] = Future()
    try:
        done.set_result(call(*args))
    except Exception as exc:  # noqa: BLE001 - raised to the caller as a thread's would be
        done.set_exception(exc)
    return done


class ChecksumMismatch(KVBlobError):
    reason = "checksum"


class FingerprintMismatch(KVBlobError):
    reason = "fingerprint"


@dataclass(frozen=True)
class StoredBlob:
    """Where a blob went and what it weighs (recorded in Postgres)."""

    location: str
    nbytes: int
    checksum: str


class _CountingLRU(LRUCache[str, KVBlob]):
    """cachetools' LRU bounded by the values' bytes, counting what it evicts per tier."""

    def __init__(self, budget_bytes: int, tier: str) -> None:
        super().__init__(maxsize=budget_bytes, getsizeof=lambda blob: blob.nbytes)
        self.tier = tier

    def popitem(self) -> tuple[str, KVBlob]:
        KV_METRICS.evictions.labels(self.tier).inc()
        return super().popitem()


class ByteLRU:
    """Thread-safe LRU bounded by the total bytes of its values (``used`` <= ``budget``); a
    value larger than the budget is not kept."""

    def __init__(self, budget_bytes: int, tier: str) -> None:
        self.tier = tier
        self._items = _CountingLRU(budget_bytes, tier)
        self._lock = threading.Lock()

    @property
    def budget(self) -> int:
        return int(self._items.maxsize)

    @property
    def used(self) -> int:
        return int(self._items.currsize)

    def get(self, key: str, checksum: str | None = None) -> KVBlob | None:
        """The blob held under ``key`` (with ``checksum``: only if it is that version)."""
        with self._lock:
            blob = self._items.get(key)
            if blob is not None and checksum not in (None, blob.checksum):
                blob = None
        KV_METRICS.cache_lookups.labels(self.tier, "hit" if blob else "miss").inc()
        return blob

    def put(self, key: str, blob: KVBlob) -> None:
        if blob.nbytes > self.budget:
            return
        with self._lock:
            self._items[key] = blob

    def pop(self, key: str) -> None:
        with self._lock:
            self._items.pop(key, None)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


class KVStore:
    """Durable tier plus in-memory LRU tiers (host RAM; device when it is not CPU)."""

    def __init__(self, durable: Durable, fingerprint: str, host_bytes: int, device_bytes: int = 0,
                 device: torch.device | str = "cpu", arena_bytes: int | None = None,
                 pinned: bool | None = None):
        self.durable = durable
        self.fingerprint = fingerprint
        self.device = torch.device(device)
        self.host = ByteLRU(host_bytes, "host")
        # A CUDA store reads page-ins into pinned memory (PyTorch's caching host allocator
        # reuses it), so host-tier blobs go to the device in non-blocking copies at the link's
        # speed; ``pinned=False`` reads them into pageable memory (for comparison).
        self.pinned = self.device.type == "cuda" if pinned is None else pinned
        # Elsewhere page-ins read into reused, huge-page-backed memory, by default 1.25x the host
        # tier's budget (block rounding, and blobs evicted while a request still reads them), at
        # least PAGE_IN_ARENA_MIN; 0: none
        if arena_bytes is None:
            arena_bytes = max(host_bytes * 5 // 4, PAGE_IN_ARENA_MIN)
        self.arena = HostArena(arena_bytes) if arena_bytes and not self.pinned else None
        # what page-ins are read into: pinned memory, the arena's blocks or fresh memory
        self._page_in_buffer = (pinned_buffer if self.pinned
                                else self.arena.take if self.arena else None)
        self.hot = ByteLRU(device_bytes, "device") if self.device.type != "cpu" else None
        # host blobs whose non-blocking copies to the device may still be reading them, with
        # the event that marks their end: kept alive until then, so their memory is not reused
        self._copying: deque[tuple[torch.cuda.Event, list[KVBlob]]] = deque()
        # page-ins run on every CPU of the process, also where the thread starting them is
        # pinned to one (vLLM's CPU worker)
        self._pool = ThreadPoolExecutor(durable.read_threads, thread_name_prefix="kv-page-in",
                                        initializer=run_on_process_cpus)
        # location -> (version, checksum) of the last version read there whose content hashed
        # to its checksum: reading that version again hashes nothing (half a page-in's CPU)
        self._verified: LRUCache[str, tuple[Hashable, str]] = LRUCache(VERIFIED_VERSIONS)
        self._verified_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings, fingerprint: str, host_bytes: int,
                      device_bytes: int = 0, device: torch.device | str = "cpu") -> KVStore:
        """A store on the durable tier the settings name (``kv_url`` / ``kv_path``)."""
        return cls(open_durable(settings), fingerprint, host_bytes, device_bytes, device)

    # --- durable tier -------------------------------------------------------------------------

    def location_for(self, name: BlobName) -> str:
        """Relative location of the blob ``name`` for this store's model."""
        return name.location(self.fingerprint)

    def locations_of(self, names: Iterable[BlobName]) -> list[str]:
        """Where blobs named ``names`` would be for every model this durable tier holds (the
        models are listed once: one LIST request on S3, not one per name)."""
        models = list(self.durable.folders())
        return [name.location(model) for name in names for model in models]

    def exists(self, name: BlobName) -> bool:
        """Whether this model's durable blob ``name`` exists."""
        return self.durable.exists(self.location_for(name))

    def put(self, name: BlobName, k: torch.Tensor, v: torch.Tensor, token_ids: list[int],
            window: int, kv_format: str = RAW) -> StoredBlob:
        """Write a blob durably and atomically, K/V stored in ``kv_format``; identical rewrites
        are harmless."""
        data, checksum = encode_blob(k, v, token_ids, self.fingerprint, window, kv_format)
        location = self.location_for(name)
        self.durable.write(location, data)
        return StoredBlob(location=location, nbytes=len(data), checksum=checksum)

    def _verified_blob(self, location: str, raw: bytes | memoryview, version: Hashable | None,
                       expected_checksum: str | None) -> KVBlob:
        """The blob read from ``location`` (at ``version``), its checksum and fingerprint
        checked (hashed once per version)."""
        known = None
        if version is not None:
            with self._verified_lock:
                last = self._verified.get(location)
            known = last[1] if last is not None and last[0] == version else None
        try:
            blob, checksum = decode_blob(raw, known)
        except Exception as exc:  # noqa: BLE001 - any parse failure is a corrupt blob
            raise ChecksumMismatch(location, f"unreadable blob: {exc}") from None
        KV_METRICS.page_in_checks.labels("known_version" if known else "hashed").inc()
        if version is not None and checksum is not None and known is None:
            with self._verified_lock:
                self._verified[location] = version, checksum
        if blob.fingerprint != self.fingerprint:
            raise FingerprintMismatch(
                location, f"made for {blob.fingerprint[:16]}, serving {self.fingerprint[:16]}")
        if checksum is None or (expected_checksum and checksum != expected_checksum):
            raise ChecksumMismatch(location, "content does not match its checksum")
        KV_METRICS.page_in_bytes.inc(len(raw))
        return blob

    def sweep_temp(self) -> int:
        """Remove what writers that died mid-write left in the durable tier."""
        return self.durable.sweep_temp()

    # --- tiered reads -------------------------------------------------------------------------

    def _on_device(self, location: str, blob: KVBlob, sources: list[KVBlob]) -> KVBlob:
        """The blob copied to the device (not waiting for the copy) and put in the device
        tier; the host blob joins ``sources`` (see ``_keep_until_copied``)."""
        if self.hot is None:
            return blob
        sources.append(blob)
        on_device = blob.to(self.device, non_blocking=True)
        self.hot.put(location, on_device)
        return on_device

    def _keep_until_copied(self, sources: list[KVBlob]) -> None:
        """Hold the host blobs of this call's non-blocking copies until the device's stream
        has run past them (checked without waiting), and let go of earlier ones that are done:
        a pinned buffer freed while a copy reads it could be refilled by the next page-in."""
        while self._copying and self._copying[0][0].query():
            self._copying.popleft()
        if sources and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._copying.append((event, sources))

    def _from_memory(self, location: str, expected_checksum: str | None,
                     sources: list[KVBlob]) -> KVBlob | None:
        """The blob from the device or host cache (moved to the device), or None (also when the
        copy there is not the version expected)."""
        if self.hot is not None and (
                blob := self.hot.get(location, expected_checksum)) is not None:
            return blob
        blob = self.host.get(location, expected_checksum)
        return None if blob is None else self._on_device(location, blob, sources)

    def _page_in(self, location: str, expected_checksum: str | None,
                 read: Read | None = None,
                 seconds: float = 0.0) -> KVBlob:
        """The blob from the durable tier (or as already ``read`` from it, in ``seconds``),
        verified, cached in host RAM. Thread-safe: device copies stay on the caller's thread
        (its current device and stream)."""
        started = time.perf_counter()
        try:
            if read is None:
                read = self.durable.read_versioned(location, self._page_in_buffer)
            blob = self._verified_blob(location, *read, expected_checksum)
        finally:
            KV_METRICS.page_in_seconds.observe(seconds + time.perf_counter() - started)
        self.host.put(location, blob)
        return blob

    def get(self, location: str, expected_checksum: str | None = None) -> KVBlob:
        """The blob on this store's device: device cache -> host cache -> durable (verified)."""
        sources: list[KVBlob] = []
        blob = self._from_memory(location, expected_checksum, sources)
        if blob is None:
            blob = self._on_device(location, self._page_in(location, expected_checksum), sources)
        self._keep_until_copied(sources)
        return blob

    def get_many(self, locations: list[str], checksums: list[str | None]) -> list[KVBlob]:
        """The blobs at ``locations`` (with their expected checksums), in order, as ``get``
        gives them: memory-tier hits first, then the misses paged in: read many at a time where
        the durable tier can (a local directory) and checked here as they come, read and checked
        concurrently otherwise. Every page-in has ended when it returns; the error of the first
        blob that failed is raised."""
        if len(locations) != len(checksums):
            raise ValueError(f"{len(locations)} locations but {len(checksums)} checksums")
        sources: list[KVBlob] = []
        blobs = [self._from_memory(location, checksum, sources)
                 for location, checksum in zip(locations, checksums, strict=True)]
        wanted = list(dict.fromkeys((location, checksum) for location, checksum, blob
                                    in zip(locations, checksums, blobs, strict=True)
                                    if blob is None))
        # Blobs the storage reads many at a time (a local directory) are checked here as they
        # come, while the threads read the next ones: a check is mostly Python, which on the
        # threads only queued on the GIL (k = 50 int4 blobs from the page cache, 2 CPUs: ~8 ms
        # here, ~17 ms on the threads; raw blobs 15 and 19 ms). The others are read and checked
        # on the threads.
        misses: dict[tuple[str, str | None], Future[KVBlob]] = {}
        started = time.perf_counter()
        with contextlib.closing(self.durable.read_many(
                [location for location, _ in wanted], self._page_in_buffer, self._pool)) as reads:
            for key, read in zip(wanted, reads, strict=True):
                seconds, started = time.perf_counter() - started, time.perf_counter()
                misses[key] = (self._pool.submit(self._page_in, *key) if read is None
                               else _finished(self._page_in, *key, read, seconds))
        wait(misses.values())
        out = [blob if blob is not None else self._on_device(
                   location, misses[location, checksum].result(), sources)
               for location, checksum, blob in zip(locations, checksums, blobs, strict=True)]
        self._keep_until_copied(sources)
        return out

    def load(self, name: BlobName, expected_checksum: str | None = None) -> KVBlob:
        """This model's blob ``name``, through the tiers (see ``get``)."""
        return self.get(self.location_for(name), expected_checksum)

    def load_many(self, names: list[BlobName], checksums: list[str | None]) -> list[KVBlob]:
        """This model's blobs ``names``, through the tiers (see ``get_many``)."""
        return self.get_many([self.location_for(name) for name in names], checksums)

    def evict(self, locations: list[str]) -> int:
        """Drop blobs (and their facts' lead blobs) from the memory tiers (host, device);
        returns how many of ``locations`` were held, either blob counting."""
        held = 0
        for location in locations:
            variants = with_leads([location])
            held += any(v in self.host or (self.hot is not None and v in self.hot)
                        for v in variants)
            for variant in variants:
                self.host.pop(variant)
                if self.hot is not None:
                    self.hot.pop(variant)
        return held

    def memory_tiers(self, locations: list[str]) -> list[list[str]]:
        """For each location, the memory tiers ("host", "device") holding its blob or its
        fact's lead blob."""
        return [[tier.tier for tier in (self.host, self.hot) if tier is not None
                 and any(variant in tier for variant in with_leads([location]))]
                for location in locations]

    def delete(self, locations: list[str]) -> int:
        """Remove blobs (and their facts' lead blobs) from every tier; returns how many durable
        blobs were removed."""
        self.evict(locations)
        return self.durable.delete_many(with_leads(locations))

    def fact_blobs(self) -> Iterator[tuple[FactId, str]]:
        """(fact id, location) of every durable fact blob and lead blob, of any model."""
        for location in self.durable.list():
            name = parse_location(location)
            if name is not None and name.fact_id is not None:
                yield name.fact_id, location
