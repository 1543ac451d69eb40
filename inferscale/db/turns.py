"""Turn and fact writes (idempotent upserts on natural keys), per-user locks and tombstones. All
SQL is parameterized."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import (
    func,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from inferscale.db.tables import facts, forgotten_users, turns


@dataclass(frozen=True)
class StoredTurn:
    """A turn to persist, with where it came from."""

    user_id: str
    conversation_id: str
    turn_id: str
    speaker: str
    text: str
    ts: datetime
    agent_id: str | None = None
    run_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # given to its facts
    source_topic: str | None = None
    source_partition: int | None = None
    source_offset: int | None = None

@dataclass(frozen=True)
class NewFact:
    """A fact extracted from one or more turns, with its embedding."""

    user_id: str
    conversation_id: str
    turn_ids: tuple[str, ...]
    ordinal: int
    extractor: str
    text: str
    ts: datetime
    embedding: Sequence[float]
    agent_id: str | None = None  # its turn's scopes
    run_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # its turn's

async def upsert_turns(conn: AsyncConnection, rows: Sequence[StoredTurn]) -> int:
    """Insert turns, ignoring ones already stored (natural key). Returns how many were new."""
    if not rows:
        return 0
    stmt = (
        insert(turns)
        .values([r.__dict__ for r in rows])
        .on_conflict_do_nothing(index_elements=["user_id", "conversation_id", "turn_id"])
        .returning(turns.c.turn_id)
    )
    return len((await conn.execute(stmt)).all())

async def upsert_facts(conn: AsyncConnection, rows: Sequence[NewFact]) -> int:
    """Insert facts, ignoring ones already stored (natural key). Returns how many were new."""
    if not rows:
        return 0
    values = [{**r.__dict__, "turn_ids": list(r.turn_ids), "embedding": list(r.embedding)}
              for r in rows]
    stmt = (
        insert(facts)
        .values(values)
        .on_conflict_do_nothing(constraint="uq_facts_source")
        .returning(facts.c.id)
    )
    return len((await conn.execute(stmt)).all())

async def count_user_rows(conn: AsyncConnection, user_id: str) -> tuple[int, int]:
    """(turns, facts) stored for one user."""
    n_turns = await conn.execute(select(func.count()).where(turns.c.user_id == user_id))
    n_facts = await conn.execute(select(func.count()).where(facts.c.user_id == user_id))
    return n_turns.scalar_one(), n_facts.scalar_one()

async def lock_users(conn: AsyncConnection, user_ids: Sequence[str], exclusive: bool) -> None:
    """Transaction-scoped per-user locks: ingest takes its batch's users shared, forget its one
    user exclusive (so no lock cycle can form), and a forget never interleaves with a store of
    the same user's turns."""
    lock = "pg_advisory_xact_lock" if exclusive else "pg_advisory_xact_lock_shared"
    await conn.execute(text(f"SELECT {lock}(hashtextextended(u, 0)) "
                            "FROM unnest(CAST(:users AS text[])) u"),
                       {"users": sorted(set(user_ids))})

async def tombstones(conn: AsyncConnection, user_ids: Sequence[str]) -> dict[str, datetime]:
    """When each of these users was forgotten (users never forgotten are absent)."""
    rows = await conn.execute(select(forgotten_users.c.user_id, forgotten_users.c.forgotten_at)
                              .where(forgotten_users.c.user_id.in_(sorted(set(user_ids)))))
    return {row.user_id: row.forgotten_at for row in rows}
