"""Forgetting a user's rows (a tombstone stays) and telling which facts may still own blobs.
All SQL is parameterized."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import (
    BigInteger,
    any_,
    bindparam,
    delete,
    func,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.ext.asyncio import AsyncConnection

from inferscale.db.tables import facts, forgotten_users, turns
from inferscale.db.turns import lock_users


async def delete_user(conn: AsyncConnection, user_id: str) -> tuple[list[int], list[str]]:
    """Delete a user's turns and facts and leave a tombstone; returns the deleted fact ids and
    the KV locations recorded for them (blobs to remove from every tier)."""
    await lock_users(conn, [user_id], exclusive=True)
    rows = (await conn.execute(
        delete(facts).where(facts.c.user_id == user_id).returning(facts.c.id,
                                                                  facts.c.kv_location))).all()
    await conn.execute(delete(turns).where(turns.c.user_id == user_id))
    now = func.clock_timestamp()
    await conn.execute(insert(forgotten_users).values(user_id=user_id, forgotten_at=now)
                       .on_conflict_do_update(index_elements=["user_id"],
                                              set_={"forgotten_at": now}))
    return [row.id for row in rows], [row.kv_location for row in rows if row.kv_location]

async def fact_ids_owning_blobs(conn: AsyncConnection, fact_ids: Sequence[int]) -> set[int]:
    """Which of these facts may own KV blobs: those that still have a row, except facts whose
    KV was evicted and that no request wants back (what blobs they left are leftovers of an
    eviction cut short)."""
    if not fact_ids:
        return set()
    # One array parameter (= ANY): an IN list binds one parameter per id, and asyncpg takes
    # at most 32,767 of them, fewer than the blobs a bucket holds.
    ids = bindparam("ids", list(fact_ids), type_=ARRAY(BigInteger))
    evicted = (facts.c.kv_evicted_at.is_not(None) & facts.c.kv_location.is_(None)
               & facts.c.kv_wanted_at.is_(None))
    rows = await conn.execute(select(facts.c.id).where(facts.c.id == any_(ids), ~evicted))
    return set(rows.scalars().all())
