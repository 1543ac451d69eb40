"""Forget a user: turns, facts, vectors and KV blobs, from every tier, with a tombstone."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import PurePosixPath

from sqlalchemy.ext.asyncio import AsyncEngine

from inferscale.contracts.blob_name import fact_blob
from inferscale.db.deletion import blobs_owned, delete_user
from inferscale.kv.store import KVStore


@dataclass(frozen=True)
class Forgotten:
    """What one forget removed; ``locations`` are the blobs servers must purge from memory."""

    facts: int
    blobs: int
    locations: list[str]


async def forget_user(engine: AsyncEngine, store: KVStore, user_id: str) -> Forgotten:
    """Delete the user's rows and leave a tombstone, then remove their blobs (recorded or not,
    for any model) from this store's tiers.

    Rows go first so that no query can retrieve a fact whose blob is already gone.
    """
    async with engine.begin() as conn:
        fact_ids, recorded = await delete_user(conn, user_id)
    def delete() -> tuple[list[str], int]:
        named = set(store.locations_of(fact_blob(fact_id) for fact_id in fact_ids))
        locations = sorted(named | set(recorded))
        return locations, store.delete(locations)

    locations, removed = await asyncio.to_thread(delete)
    return Forgotten(len(fact_ids), removed, locations)


async def sweep_orphan_blobs(engine: AsyncEngine, store: KVStore) -> int:
    """Remove durable blobs, of any model, whose fact or whose fact's row for that model no
    longer exists (an encode that finished after its user was forgotten, or whose rows were
    rolled back and deleted; KV of a model migrated away from) or whose KV was evicted (an
    eviction that died before deleting them); returns how many."""
    blobs = await asyncio.to_thread(lambda: list(store.fact_blobs()))
    async with engine.connect() as conn:
        owned = await blobs_owned(conn, sorted({fact_id for fact_id, _ in blobs}))
    orphans = [location for fact_id, location in blobs
               if (fact_id, PurePosixPath(location).parts[0]) not in owned]
    return await asyncio.to_thread(store.delete, orphans)
