"""Exact nearest-fact search over an in-memory copy of each owner's fact embeddings.

Postgres stays the source of truth. Per request the index reads the owner's memory version
(one primary-key lookup, migration 0008); where it moved, it reloads the owner's live fact ids
and fetches only the embeddings it lacks (a fact's embedding never changes). Ranking is one
matrix-vector product over the owner's unit vectors; the hits' rows are then read by id, live
only, so a fact retired between the two reads is never served. Owners are kept least recently
used first out, within a byte budget.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import numpy as np
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from inferscale.db.queries import (
    RetrievedFact,
    fact_embeddings,
    live_fact_ids,
    live_facts,
    memory_version,
)

# pgvector's binary format: int16 dimensions, int16 unused, then big-endian float4s.
_HEADER = np.dtype([("dim", ">i2"), ("unused", ">i2")])
# Extra candidates read by id, so that facts retired since the version check leave k behind.
SLACK = 8


def decode_vectors(blobs: list[bytes]) -> np.ndarray:
    """pgvector binary values (one dimension) as a float32 matrix."""
    if not blobs:
        return np.zeros((0, 0), np.float32)
    dim = int(np.frombuffer(blobs[0], _HEADER, count=1)["dim"][0])
    raw = np.frombuffer(b"".join(blobs), np.uint8).reshape(len(blobs), -1)
    if raw.shape[1] != _HEADER.itemsize + 4 * dim:
        raise ValueError(f"embeddings of mixed or unexpected size ({raw.shape[1]} bytes)")
    return raw[:, _HEADER.itemsize:].copy().view(">f4").astype(np.float32)


@dataclass(frozen=True)
class OwnerVectors:
    """One owner's live facts at one memory version: ids ascending, unit rows."""

    version: int
    ids: np.ndarray  # int64, (n,)
    matrix: np.ndarray  # float32, (n, dim)

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.matrix.nbytes

    def nearest(self, query: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, cosine distances) of the n nearest rows, nearest first, ties by id."""
        if n <= 0 or not len(self.ids):
            return self.ids[:0], np.zeros(0, np.float32)
        scores = self.matrix @ query
        if n < len(scores):
            kth = np.partition(scores, len(scores) - n)[len(scores) - n]
            candidates = np.flatnonzero(scores >= kth)  # every tie at the boundary
        else:
            candidates = np.arange(len(scores))
        order = candidates[np.lexsort((self.ids[candidates], -scores[candidates]))][:n]
        return self.ids[order], 1.0 - scores[order]


def _unit(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return rows / np.where(norms > 0, norms, 1)


class OwnerIndex:
    """Per-owner embedding matrices kept current against Postgres (one per server process)."""

    def __init__(self, engine: AsyncEngine, max_bytes: int):
        self.engine = engine
        self.max_bytes = max_bytes
        self._owners: OrderedDict[str, OwnerVectors] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self._owners.values())

    async def search(self, user_id: str, query: np.ndarray, k: int,
                     owner: OwnerVectors | None = None) -> list[RetrievedFact]:
        """The owner's k live facts nearest to ``query``, nearest first (exact); ``owner``:
        their vectors from a ``current`` call made for this request."""
        if k <= 0:
            return []
        query = _unit(np.asarray(query, np.float32))
        for attempt in range(2):
            owner = owner or await self.current(user_id)
            ids, distances = owner.nearest(query, k + SLACK)
            async with self._connect() as conn:
                rows = await live_facts(conn, user_id, ids.tolist())
            if len(rows) == len(ids) or attempt:
                break
            self._owners.pop(user_id, None)  # changed since the version check: reload once
            owner = None
        return [RetrievedFact(distance=float(d), **rows[i])
                for i, d in zip(ids.tolist(), distances.tolist(), strict=True) if i in rows][:k]

    async def current(self, user_id: str) -> OwnerVectors:
        """The owner's vectors at the memory version Postgres has now."""
        async with self._connect() as conn:
            version = await memory_version(conn, user_id)
        cached = self._owners.get(user_id)
        if cached is not None and cached.version == version:
            self._owners.move_to_end(user_id)
            return cached
        async with self._locks.setdefault(user_id, asyncio.Lock()):
            cached = self._owners.get(user_id)  # a concurrent reload may have done it
            if cached is None or cached.version < version:
                cached = await self._reload(user_id, cached)
                self._keep(user_id, cached)
        return cached

    async def _reload(self, user_id: str, cached: OwnerVectors | None) -> OwnerVectors:
        async with self._connect() as conn:
            version, ids = await live_fact_ids(conn, user_id)
            ids_now = np.asarray(ids, np.int64)
            held = cached.ids if cached is not None else ids_now[:0]
            missing = np.setdiff1d(ids_now, held, assume_unique=True)
            fetched = await fact_embeddings(conn, missing.tolist()) if len(missing) else []
        if len(fetched) != len(missing):  # deleted since the id list: reload next time
            version = -1
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, _merge, version, ids_now, cached, fetched)

    def _keep(self, user_id: str, owner: OwnerVectors) -> None:
        self._owners[user_id] = owner
        self._owners.move_to_end(user_id)
        while len(self._owners) > 1 and self.nbytes > self.max_bytes:
            evicted, _ = self._owners.popitem(last=False)
            self._locks.pop(evicted, None)

    @asynccontextmanager
    async def _connect(self) -> AsyncIterator[AsyncConnection]:
        """One autocommit connection: single statements need no BEGIN / COMMIT round trips."""
        async with self.engine.connect() as conn:
            yield await conn.execution_options(isolation_level="AUTOCOMMIT")


def _merge(version: int, ids: np.ndarray, cached: OwnerVectors | None,
           fetched: list[tuple[int, bytes]]) -> OwnerVectors:
    """The rows of ``ids`` from the cached matrix and the fetched embeddings (off the loop)."""
    fetched_ids = np.asarray([i for i, _ in fetched], np.int64)
    fetched_rows = _unit(decode_vectors([blob for _, blob in fetched]))
    if cached is not None and len(cached.ids):
        all_ids = np.concatenate([cached.ids, fetched_ids])
        rows = (np.concatenate([cached.matrix, fetched_rows]) if len(fetched_ids)
                else cached.matrix)
    else:
        all_ids, rows = fetched_ids, fetched_rows
    keep = np.isin(all_ids, ids, assume_unique=True)
    order = np.argsort(all_ids[keep], kind="stable")
    return OwnerVectors(version, all_ids[keep][order], rows[keep][order])
