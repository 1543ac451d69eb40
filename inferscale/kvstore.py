"""Tiered store of per-fact KV blobs: durable directory -> host-RAM LRU -> device hot cache.

Blobs are named (a fact id, or "preamble") and encoded by ``inferscale.blob``; callers use
names (``exists``, ``put``, ``load``) or the locations recorded in Postgres (``get``), never
paths. Durable writes are atomic (temp file, fsync, rename); checksum and fingerprint are
verified when a blob is paged in from the durable tier.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from inferscale import failpoints
from inferscale.blob import KVBlob, decode_blob, encode_blob
from inferscale.metrics import KV_METRICS
from inferscale.procs import pid_alive


class KVBlobError(RuntimeError):
    """A blob that cannot be used; serving falls back to prefilling the fact's text."""

    reason = "error"

    def __init__(self, location: str, detail: str):
        super().__init__(f"{self.reason}: {location}: {detail}")
        self.location = location


class BlobMissing(KVBlobError):
    reason = "missing"


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


class ByteLRU:
    """Thread-safe LRU bounded by the total bytes of its values."""

    def __init__(self, budget_bytes: int, tier: str):
        self.budget = budget_bytes
        self.tier = tier
        self.used = 0
        self._items: OrderedDict[str, KVBlob] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> KVBlob | None:
        with self._lock:
            blob = self._items.get(key)
            if blob is not None:
                self._items.move_to_end(key)
        KV_METRICS.cache_lookups.labels(self.tier, "hit" if blob else "miss").inc()
        return blob

    def put(self, key: str, blob: KVBlob) -> None:
        if blob.nbytes > self.budget:
            return
        with self._lock:
            if (old := self._items.pop(key, None)) is not None:
                self.used -= old.nbytes
            self._items[key] = blob
            self.used += blob.nbytes
            while self.used > self.budget:
                _, evicted = self._items.popitem(last=False)
                self.used -= evicted.nbytes
                KV_METRICS.evictions.labels(self.tier).inc()

    def pop(self, key: str) -> None:
        with self._lock:
            if (old := self._items.pop(key, None)) is not None:
                self.used -= old.nbytes

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


class KVStore:
    """Durable directory tier plus in-memory LRU tiers (host RAM; device when it is not CPU)."""

    def __init__(self, root: Path, fingerprint: str, host_bytes: int, device_bytes: int = 0,
                 device: torch.device | str = "cpu"):
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.device = torch.device(device)
        self.host = ByteLRU(host_bytes, "host")
        self.hot = ByteLRU(device_bytes, "device") if self.device.type != "cpu" else None

    # --- durable tier -------------------------------------------------------------------------

    def location_for(self, name: str, fingerprint: str | None = None) -> str:
        """Relative location of a blob named ``name`` (a fact id or "preamble") for this
        store's model (or the model with ``fingerprint``, which may be its 16-char prefix)."""
        shard = hashlib.sha1(name.encode()).hexdigest()[:2]
        return f"{(fingerprint or self.fingerprint)[:16]}/{shard}/{name}.safetensors"

    def locations_of(self, name: str) -> list[str]:
        """Where a blob named ``name`` would be for every model this durable tier holds."""
        models = [d.name for d in self.root.iterdir() if d.is_dir()] if self.root.is_dir() else []
        return [self.location_for(name, model) for model in models]

    def exists(self, name: str) -> bool:
        """Whether this model's durable blob ``name`` exists."""
        return (self.root / self.location_for(name)).exists()

    def put(self, name: str, k: torch.Tensor, v: torch.Tensor, token_ids: list[int],
            window: int) -> StoredBlob:
        """Write a blob durably and atomically; identical rewrites are harmless."""
        data, checksum = encode_blob(k, v, token_ids, self.fingerprint, window)
        location = self.location_for(name)
        path = self.root / location
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with tmp.open("wb") as f:
                f.write(data[:len(data) // 2])
                failpoints.hit("kv.mid_write")
                f.write(data[len(data) // 2:])
                f.flush()
                os.fsync(f.fileno())
            failpoints.hit("kv.before_rename")
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        return StoredBlob(location=location, nbytes=len(data), checksum=checksum)

    def _read_durable(self, location: str, expected_checksum: str | None) -> KVBlob:
        path = self.root / location
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise BlobMissing(location, "no such blob") from None
        try:
            blob, checksum = decode_blob(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is a corrupt blob
            raise ChecksumMismatch(location, f"unreadable blob: {exc}") from None
        if blob.fingerprint != self.fingerprint:
            raise FingerprintMismatch(
                location, f"made for {blob.fingerprint[:16]}, serving {self.fingerprint[:16]}")
        if checksum is None or (expected_checksum and checksum != expected_checksum):
            raise ChecksumMismatch(location, "content does not match its checksum")
        KV_METRICS.page_in_bytes.inc(len(raw))
        return blob

    def sweep_temp(self) -> int:
        """Remove temp files left by writers that died mid-write (their pid is gone)."""
        removed = 0
        for tmp in self.root.glob("*/*/.*.tmp"):
            try:
                pid = int(tmp.name.rsplit(".", 3)[-3])
            except (ValueError, IndexError):
                continue
            if pid != os.getpid() and not pid_alive(pid):
                tmp.unlink(missing_ok=True)
                removed += 1
        return removed

    # --- tiered reads -------------------------------------------------------------------------

    def get(self, location: str, expected_checksum: str | None = None) -> KVBlob:
        """The blob on this store's device: device cache -> host cache -> durable (verified)."""
        if self.hot is not None and (blob := self.hot.get(location)) is not None:
            return blob
        blob = self.host.get(location)
        if blob is None:
            with KV_METRICS.page_in_seconds.time():
                blob = self._read_durable(location, expected_checksum)
            self.host.put(location, blob)
        if self.hot is not None:
            blob = KVBlob(k=blob.k.to(self.device, non_blocking=True),
                          v=blob.v.to(self.device, non_blocking=True),
                          token_ids=blob.token_ids, fingerprint=blob.fingerprint,
                          window=blob.window)
            self.hot.put(location, blob)
        return blob

    def load(self, name: str, expected_checksum: str | None = None) -> KVBlob:
        """This model's blob ``name``, through the tiers (see ``get``)."""
        return self.get(self.location_for(name), expected_checksum)

    def evict(self, locations: list[str]) -> int:
        """Drop blobs from the memory tiers (host, device); returns how many were held."""
        held = 0
        for location in locations:
            held += location in self.host or (self.hot is not None and location in self.hot)
            self.host.pop(location)
            if self.hot is not None:
                self.hot.pop(location)
        return held

    def delete(self, locations: list[str]) -> int:
        """Remove blobs from every tier; returns how many durable files were removed."""
        self.evict(locations)
        removed = 0
        for location in locations:
            path = self.root / location
            if path.exists():
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def fact_blobs(self) -> Iterator[tuple[int, str]]:
        """(fact id, location) of every durable fact blob, of any model."""
        for path in self.root.glob("*/*/*.safetensors"):
            if path.stem.isdigit():
                yield int(path.stem), str(path.relative_to(self.root))
