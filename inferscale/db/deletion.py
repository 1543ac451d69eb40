"""Forgetting a user's rows (a tombstone stays) and telling which (fact, model) pairs may still
own blobs. All SQL is parameterized."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import (
    BigInteger,
    BindParameter,
    any_,
    bindparam,
    delete,
    func,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.ext.asyncio import AsyncConnection

from inferscale.contracts.blob_name import FactId
from inferscale.db.tables import fact_kv, facts, forgotten_users, memory_events, turns
from inferscale.db.turns import lock_users


async def delete_user(conn: AsyncConnection, user_id: str
                      ) -> tuple[list[FactId], list[str]]:
    """Delete a user's turns and facts and leave a tombstone; returns the deleted fact ids and
    the KV locations recorded for them, for every model (blobs to remove from every tier)."""
    await lock_users(conn, [user_id], exclusive=True)
    # Lock the facts first (as recording an encoding does), then read what KV they hold:
    # an encode recorded meanwhile has committed by then, one recorded later finds them gone.
    ids = list((await conn.execute(select(facts.c.id).where(facts.c.user_id == user_id)
                                   .order_by(facts.c.id).with_for_update())).scalars())
    locations = [location for held in (await kv_locations(conn, ids)).values()
                 for location in held]
    await conn.execute(delete(facts).where(facts.c.user_id == user_id))
    await conn.execute(delete(turns).where(turns.c.user_id == user_id))
    await conn.execute(delete(memory_events).where(memory_events.c.user_id == user_id))
    now = func.clock_timestamp()
    await conn.execute(insert(forgotten_users).values(user_id=user_id, forgotten_at=now)
                       .on_conflict_do_update(index_elements=["user_id"],
                                              set_={"forgotten_at": now}))
    return ids, locations

def _ids(fact_ids: Sequence[int]) -> BindParameter:
    # One array parameter (= ANY): an IN list binds one parameter per id, and asyncpg takes
    # at most 32,767 of them, fewer than the blobs a bucket holds.
    return bindparam("ids", list(fact_ids), type_=ARRAY(BigInteger))

async def kv_locations(conn: AsyncConnection, fact_ids: Sequence[int]) -> dict[int, list[str]]:
    """Where these facts' KV is, for every model (facts without any: absent). Read after the
    facts' rows were locked or retired: an encode recorded meanwhile has committed by then, and
    one recorded later finds its fact gone."""
    rows = await conn.execute(select(fact_kv.c.fact_id, fact_kv.c.kv_location).where(
        fact_kv.c.fact_id == any_(_ids(fact_ids)), fact_kv.c.kv_location.is_not(None)))
    held: dict[int, list[str]] = {}
    for fact_id, location in rows.all():
        held.setdefault(fact_id, []).append(location)
    return held

async def blobs_owned(conn: AsyncConnection, fact_ids: Sequence[int]) -> set[tuple[int, str]]:
    """Which (fact id, model fingerprint's 16-char prefix) pairs among these facts' may own KV
    blobs: the facts' rows for registered models, except rows whose KV was evicted and that no
    request wants back (what blobs they left are leftovers of an eviction cut short)."""
    if not fact_ids:
        return set()
    k = fact_kv.c
    evicted = k.kv_evicted_at.is_not(None) & k.kv_location.is_(None) & k.kv_wanted_at.is_(None)
    rows = await conn.execute(select(k.fact_id, func.left(k.model_fingerprint, 16))
                              .where(k.fact_id == any_(_ids(fact_ids)), ~evicted))
    return {(fact_id, model) for fact_id, model in rows.all()}
