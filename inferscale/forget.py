"""Forget a user: turns, facts, vectors and KV blobs, from every tier."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from inferscale.db.queries import delete_user
from inferscale.kvstore import KVStore


async def forget_user(engine: AsyncEngine, store: KVStore, user_id: str) -> tuple[int, int]:
    """Delete the user's rows, then their blobs; returns (facts deleted, blobs removed).

    Rows go first so that no query can retrieve a fact whose blob is already gone.
    """
    async with engine.begin() as conn:
        locations = await delete_user(conn, user_id)
    return len(locations), store.delete(locations)
