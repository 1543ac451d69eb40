"""Exact nearest-fact search over an in-memory copy of each owner's fact embeddings.

Postgres stays the source of truth: a memory version per owner (migration 0008), read with
the hits' rows in one statement. Where it moved and nothing was retired since, the index
fetches the facts stored since (ids above the last it holds; the counters prove none was
missed); else it re-reads the owner's live ids and fetches only the embeddings it lacks (a
fact's embedding never changes); then it ranks again. Ranking is one matrix-vector product
over the owner's unit vectors (a scoped or filtered search ranks the rows of its scope passing
its filter, ``contracts/filters.py``'s Python path: a fact's scope, metadata and time, like its
embedding, never change); rows are read by id, live only. Owners are kept within a byte
budget, least recently used first out; an owner with more facts than the whole budget holds
is ranked by Postgres instead (exact, slower: ~2.5 us per fact), and so is a filtered search
whose conditions x facts pass ``filter_inline_cost`` (the filter is evaluated in Python, fact by
fact: past that it would hold the event loop, and every stream with it); past
``filter_max_cost`` it is refused (413).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import numpy as np
from cachetools import LRUCache
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from inferscale.contracts.filters import EVERYTHING, Node, Subject, conditions, matches
from inferscale.contracts.scope import ANY, SCOPE_FIELDS, Scope
from inferscale.db.reads import (
    MemoryDelta,
    RetrievedFact,
    StoredEmbedding,
    fact_embeddings,
    live_facts,
    memory_delta,
    memory_version,
    top_k_facts,
)
from inferscale.db.tables import EMBEDDING_DIM
from inferscale.serving.guards import FrontendError

# pgvector's binary format: int16 dimensions, int16 unused, then big-endian float4s.
_HEADER = np.dtype([("dim", ">i2"), ("unused", ">i2")])
# Extra candidates read by id, so that facts retired since the held copy was read leave k.
SLACK = 8
CATCH_UPS = 3
ROW_BYTES = EMBEDDING_DIM * 4 + 8  # one fact's vector and id


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
    """One owner's live facts at one memory version: ids ascending, their unit vectors in the
    first rows of ``buffer`` (rows past them are room for facts stored later), their scopes
    (one object array per field of ``SCOPE_FIELDS``, None where unset), what filters read of
    each (``subjects``), when each expires (POSIX seconds, inf: never; an expired fact is
    never a result, whatever the version) and which are pinned."""

    version: int  # -1: read while it changed; reloaded on the next request
    inserted: int  # the owner's counters when read (``MemoryDelta``)
    retired: int
    ids: np.ndarray  # int64, (n,)
    buffer: np.ndarray  # float32, (capacity >= n, dim)
    scopes: tuple[np.ndarray, ...]  # object, (n,) each
    subjects: np.ndarray  # object, (n,): a filters.Subject per fact
    expires: np.ndarray  # float64, (n,)
    pinned: np.ndarray  # bool, (n,)

    @property
    def matrix(self) -> np.ndarray:
        return self.buffer[:len(self.ids)]

    @property
    def nbytes(self) -> int:
        return (self.ids.nbytes + self.buffer.nbytes + self.expires.nbytes
                + self.pinned.nbytes + sum(s.nbytes for s in self.scopes))

    def nearest(self, query: np.ndarray, n: int, scope: Scope = ANY, where: Node = EVERYTHING,
                now: float | None = None, pinned: bool | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """(ids, cosine distances) of the n nearest rows in ``scope`` passing ``where`` and
        not expired at ``now`` (None: the clock's), nearest first, ties by id; ``pinned``:
        only pinned rows (True), only the others (False), any (None)."""
        ids, matrix = self.chosen(scope, where, now, pinned)
        if n <= 0 or not len(ids):
            return ids[:0], np.zeros(0, np.float32)
        scores = matrix @ query
        if n < len(scores):
            kth = np.partition(scores, len(scores) - n)[len(scores) - n]
            candidates = np.flatnonzero(scores >= kth)  # every tie at the boundary
        else:
            candidates = np.arange(len(scores))
        order = candidates[np.lexsort((ids[candidates], -scores[candidates]))][:n]
        return ids[order], 1.0 - scores[order]

    def chosen(self, scope: Scope = ANY, where: Node = EVERYTHING, now: float | None = None,
               pinned: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids, unit vectors) of the rows in ``scope`` passing ``where``, not expired at
        ``now`` and, unless ``pinned`` is None, pinned or not as it says; in id order."""
        rows = self.expires > (time.time() if now is None else now)
        if pinned is not None:
            rows &= self.pinned == pinned
        if scope != ANY:
            fields = dict(zip(SCOPE_FIELDS, self.scopes, strict=True))
            rows &= np.logical_and.reduce([fields[name] == value
                                           for name, value in scope.items()])
        ids, matrix, subjects = self.ids, self.matrix, self.subjects
        if not rows.all():  # a copy of the rows left only where some are left out
            ids, matrix, subjects = ids[rows], matrix[rows], subjects[rows]
        if where != EVERYTHING:
            passed = np.fromiter((matches(where, s) for s in subjects), bool, len(subjects))
            ids, matrix = ids[passed], matrix[passed]
        return ids, matrix


def _unit(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return rows / np.where(norms > 0, norms, 1)


class OwnerLRU(LRUCache[str, OwnerVectors]):
    """Owners' vectors within ``max_bytes``, least recently used out first. An owner admitted
    by its rows (``live x ROW_BYTES`` within the budget) whose spare rows take it past the
    budget counts as the whole budget: it is held alone. Each owner's reload lock leaves with
    it."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(maxsize=max_bytes, getsizeof=lambda v: min(v.nbytes, max_bytes))
        self.locks: dict[str, asyncio.Lock] = {}

    def popitem(self) -> tuple[str, OwnerVectors]:
        user_id, owner = super().popitem()
        self.locks.pop(user_id, None)
        return user_id, owner


class OwnerIndex:
    """Per-owner embedding matrices kept current against Postgres (one per server process);
    hits come with their KV for the model ``fingerprint``."""

    def __init__(self, engine: AsyncEngine, fingerprint: str, max_bytes: int,
                 filter_inline_cost: int = 20_000, filter_max_cost: int = 6_400_000):
        self.engine = engine
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.filter_inline_cost = filter_inline_cost
        self.filter_max_cost = filter_max_cost
        self._owners = OwnerLRU(max_bytes)

    @property
    def nbytes(self) -> int:
        return int(self._owners.currsize)

    def __contains__(self, user_id: object) -> bool:
        """Whether this owner's vectors are held now (else the next search loads them)."""
        return user_id in self._owners

    async def search(self, user_id: str, query: np.ndarray, k: int, scope: Scope = ANY,
                     where: Node = EVERYTHING, pinned: int = 0) -> list[RetrievedFact]:
        """The owner's k live facts in ``scope`` passing ``where`` nearest to ``query``,
        nearest first (exact); ``pinned`` > 0: the owner's pinned facts among them (at most
        that many, in id order) first, unranked, then k ranked among the others.
        Ranks the held
        vectors, then reads the hits' rows with the memory version in one statement; where the
        version moved, catches up and ranks again (under a stream of changes, after
        ``CATCH_UPS`` tries it serves the live rows of its last ranking)."""
        if k <= 0 and pinned <= 0:
            return []
        query = _unit(np.asarray(query, np.float32))
        owner = self._owners.get(user_id)  # recently used
        if owner is None:
            owner = await self.current(user_id)
        if where != EVERYTHING and await self._costly(user_id, owner, where):
            owner = None  # ranked by Postgres, off the event loop
        for _ in range(CATCH_UPS):
            if owner is None:  # larger than the budget: Postgres ranks them
                async with self._connect() as conn:
                    return await top_k_facts(conn, user_id, self.fingerprint, query.tolist(), k,
                                             scope, where, pinned)
            first = owner.chosen(scope, where, pinned=True) if pinned > 0 else None
            ids, distances = owner.nearest(query, k + SLACK if k > 0 else 0, scope, where,
                                           pinned=None if first is None else False)
            if first is not None and len(first[0]):  # first in id order, at most ``pinned``
                ids = np.concatenate([first[0][:pinned], ids])
                distances = np.concatenate([1.0 - first[1][:pinned] @ query, distances])
            async with self._connect() as conn:
                version, rows = await live_facts(conn, user_id, self.fingerprint, ids.tolist())
            if version == owner.version and len(rows) == len(ids):
                break
            if version == owner.version:  # rows gone, version kept: trust nothing held
                self._owners.pop(user_id, None)
            owner = await self.current(user_id)
        found = [RetrievedFact(distance=float(d), **rows[i])
                 for i, d in zip(ids.tolist(), distances.tolist(), strict=True) if i in rows]
        ahead = sum(f.pinned for f in found) if first is not None else 0
        return found[:ahead + k]

    async def _costly(self, user_id: str, owner: OwnerVectors | None, where: Node) -> bool:
        """Whether evaluating ``where`` over the owner's facts costs more than the event loop
        may spend on it (conditions x facts past ``filter_inline_cost``); a 413 past
        ``filter_max_cost``, wherever it would run."""
        if owner is None:
            async with self._connect() as conn:
                _, facts = await memory_version(conn, user_id)
        else:
            facts = len(owner.ids)
        cost = conditions(where) * facts
        if cost > self.filter_max_cost:
            raise FrontendError(413, f"this filter's {conditions(where)} conditions over the "
                                     f"owner's {facts} facts cost more than filter_max_cost: "
                                     "name a scope or use fewer conditions")
        return cost > self.filter_inline_cost

    async def current(self, user_id: str) -> OwnerVectors | None:
        """The owner's vectors at the memory version Postgres has now (None: more facts than
        the budget holds; they are searched in Postgres)."""
        async with self._connect() as conn:
            version, live = await memory_version(conn, user_id)
        if live * ROW_BYTES > self.max_bytes:
            self._owners.pop(user_id, None)
            return None
        cached = self._owners.get(user_id)
        if cached is not None and cached.version == version:
            return cached
        async with self._owners.locks.setdefault(user_id, asyncio.Lock()):
            cached = self._owners.get(user_id)  # a concurrent reload may have done it
            if cached is None or cached.version != version:
                cached = await self._reload(user_id, cached)
                self._owners[user_id] = cached
        return cached

    async def _reload(self, user_id: str, cached: OwnerVectors | None) -> OwnerVectors:
        """Catch up: with only facts stored since ``cached`` (no retirement), fetch just those;
        else re-read the live ids and fetch the embeddings not held."""
        async with self._connect() as conn:
            delta = None
            if cached is not None:
                after = int(cached.ids[-1]) if len(cached.ids) else 0
                delta = await memory_delta(conn, user_id, after)
                if (delta.retired != cached.retired
                        or delta.inserted - cached.inserted != len(delta.ids)):
                    delta = None  # something retired, or stored out of id order
            appending = delta is not None
            delta = delta or await memory_delta(conn, user_id, 0)
            held = cached.ids if cached is not None else np.zeros(0, np.int64)
            missing = np.setdiff1d(np.asarray(delta.ids, np.int64), held, assume_unique=True)
            fetched = await fact_embeddings(conn, missing.tolist()) if len(missing) else []
        if len(fetched) != len(missing):  # some deleted since the ids were read
            delta = replace(delta, version=-1)
        loop = asyncio.get_running_loop()
        if appending:
            assert cached is not None  # a delta to append is read only against a cached owner
            return await loop.run_in_executor(None, _append, cached, delta,
                                              _subjects(user_id, fetched), fetched)
        return await loop.run_in_executor(None, _rebuild, cached, delta,
                                          _subjects(user_id, fetched), fetched)

    @asynccontextmanager
    async def _connect(self) -> AsyncIterator[AsyncConnection]:
        """One autocommit connection: single statements need no BEGIN / COMMIT round trips."""
        async with self.engine.connect() as conn:
            yield await conn.execution_options(isolation_level="AUTOCOMMIT")


def _scopes(fetched: list[StoredEmbedding]) -> tuple[np.ndarray, ...]:
    """The fetched facts' scope fields, one object array per field."""
    return tuple(np.array([getattr(f, name) for f in fetched], object) for name in SCOPE_FIELDS)


def _expiries(fetched: list[StoredEmbedding]) -> np.ndarray:
    """When each fetched fact expires (POSIX seconds; inf: never)."""
    return np.array([f.expires_at.timestamp() if f.expires_at else np.inf for f in fetched],
                    np.float64)


def _pins(fetched: list[StoredEmbedding]) -> np.ndarray:
    """Which fetched facts are pinned."""
    return np.array([f.pinned for f in fetched], bool)


def _subjects(user_id: str, fetched: list[StoredEmbedding]) -> np.ndarray:
    """What filters read of the fetched facts, one ``Subject`` each."""
    subjects = np.empty(len(fetched), object)
    subjects[:] = [Subject(user_id, f.agent_id, f.run_id, f.created_at, f.metadata)
                   for f in fetched]
    return subjects


def _append(cached: OwnerVectors, delta: MemoryDelta, subjects: np.ndarray,
            fetched: list[StoredEmbedding]) -> OwnerVectors:
    """``cached`` plus the facts stored since, in place past its rows where the buffer has room
    (searches holding ``cached`` read only its own rows)."""
    ids = np.asarray([f.id for f in fetched], np.int64)
    rows = _unit(decode_vectors([f.embedding for f in fetched]))
    n, total = len(cached.ids), len(cached.ids) + len(ids)
    buffer = cached.buffer
    if total > len(buffer) or (len(ids) and buffer.shape[1] != rows.shape[1]):
        buffer = np.empty((_capacity(total), rows.shape[1] if len(ids) else buffer.shape[1]),
                          np.float32)
        if n:
            buffer[:n] = cached.matrix
    if len(ids):
        buffer[n:total] = rows
    scopes = tuple(np.concatenate([held, new])
                   for held, new in zip(cached.scopes, _scopes(fetched), strict=True))
    return OwnerVectors(delta.version, delta.inserted, delta.retired,
                        np.concatenate([cached.ids, ids]), buffer, scopes,
                        np.concatenate([cached.subjects, subjects]),
                        np.concatenate([cached.expires, _expiries(fetched)]),
                        np.concatenate([cached.pinned, _pins(fetched)]))


def _rebuild(cached: OwnerVectors | None, delta: MemoryDelta, subjects: np.ndarray,
             fetched: list[StoredEmbedding]) -> OwnerVectors:
    """The rows of ``delta.ids``: those ``cached`` holds, plus the fetched embeddings."""
    fetched_ids = np.asarray([f.id for f in fetched], np.int64)
    fetched_rows = _unit(decode_vectors([f.embedding for f in fetched]))
    parts_ids, parts_rows, parts_scopes = [fetched_ids], [fetched_rows], [_scopes(fetched)]
    parts_subjects, parts_expires, parts_pinned = [subjects], [_expiries(fetched)], [
        _pins(fetched)]
    if cached is not None and len(cached.ids):
        kept = np.isin(cached.ids, np.asarray(delta.ids, np.int64), assume_unique=True)
        parts_ids.insert(0, cached.ids[kept])
        parts_rows.insert(0, cached.matrix[kept])
        parts_scopes.insert(0, tuple(s[kept] for s in cached.scopes))
        parts_subjects.insert(0, cached.subjects[kept])
        parts_expires.insert(0, cached.expires[kept])
        parts_pinned.insert(0, cached.pinned[kept])
    parts_rows = [rows for rows, ids in zip(parts_rows, parts_ids, strict=True) if len(ids)]
    ids = np.concatenate(parts_ids)
    order = np.argsort(ids, kind="stable")
    dim = parts_rows[0].shape[1] if parts_rows else 0
    buffer = np.empty((_capacity(len(ids)), dim), np.float32)
    if len(ids):
        np.take(np.concatenate(parts_rows), order, axis=0, out=buffer[:len(ids)])
    scopes = tuple(np.concatenate(field)[order] for field in zip(*parts_scopes, strict=True))
    return OwnerVectors(delta.version, delta.inserted, delta.retired, ids[order], buffer,
                        scopes, np.concatenate(parts_subjects)[order],
                        np.concatenate(parts_expires)[order], np.concatenate(parts_pinned)[order])


def _capacity(n: int) -> int:
    """Rows to allocate for n facts: room for a quarter more before the next copy."""
    return n + n // 4 + 16
