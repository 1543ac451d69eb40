"""Forget a user: turns, facts, vectors and KV blobs, from every tier, with a tombstone (the
memory service's forget, and ``inferscale forget`` without a server)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from inferscale.contracts.blob_name import fact_blob
from inferscale.db.deletion import delete_user
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
