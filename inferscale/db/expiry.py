"""Facts that expire (migration 0018): the server's reads leave a fact out from its
``expires_at`` on (``reads.current``); the maintenance stage then retires it (``deleted_at``,
so its owner's memory version moves on) and hands back its KV locations, for every model, to
remove: its KV leaves the budgets. All SQL is parameterized."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from inferscale.db.deletion import kv_locations

_RETIRE_EXPIRED = text("""
    UPDATE facts SET deleted_at = clock_timestamp()
    WHERE id IN (SELECT id FROM facts
                 WHERE deleted_at IS NULL AND expires_at IS NOT NULL AND expires_at <= now()
                 ORDER BY expires_at, id LIMIT :limit FOR UPDATE SKIP LOCKED)
    RETURNING id
""")


async def retire_expired(conn: AsyncConnection, limit: int) -> tuple[list[int], list[str]]:
    """Retire up to ``limit`` expired live facts (the longest expired first; rows another
    transaction holds are left for the next round): their ids, and their KV locations for every
    model (blobs to remove)."""
    ids = sorted((await conn.execute(_RETIRE_EXPIRED, {"limit": limit})).scalars())
    held = await kv_locations(conn, ids)  # after the retirement's row locks
    return ids, [location for locations in held.values() for location in locations]
