"""Idempotent writes and the reads the workers and the server need. All SQL is parameterized."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, delete, func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from inferscale.db.tables import facts, turns


@dataclass(frozen=True)
class StoredTurn:
    """A turn to persist, with where it came from."""

    user_id: str
    conversation_id: str
    turn_id: str
    speaker: str
    text: str
    ts: datetime
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


@dataclass(frozen=True)
class RetrievedFact:
    """One retrieval hit. ``kv_location`` is None while the fact is not encoded."""

    id: int
    text: str
    distance: float
    token_ids: list[int] | None
    kv_location: str | None
    kv_checksum: str | None
    model_fingerprint: str | None


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


async def top_k_facts(
    conn: AsyncConnection, user_id: str, query_embedding: Sequence[float], k: int
) -> list[RetrievedFact]:
    """The user's k live facts nearest to the query by cosine distance, nearest first."""
    if k <= 0:
        return []
    # Exact ordering under the owner filter: let the HNSW scan continue until k rows pass it.
    await conn.execute(text("SET LOCAL hnsw.iterative_scan = strict_order"))
    distance = facts.c.embedding.cosine_distance(list(query_embedding)).label("distance")
    stmt = (
        select(
            facts.c.id,
            facts.c.text,
            distance,
            facts.c.token_ids,
            facts.c.kv_location,
            facts.c.kv_checksum,
            facts.c.model_fingerprint,
        )
        .where(and_(facts.c.user_id == user_id, facts.c.deleted_at.is_(None)))
        .order_by(distance, facts.c.id)
        .limit(k)
    )
    return [RetrievedFact(**row._mapping) for row in await conn.execute(stmt)]


async def memory_version(conn: AsyncConnection, user_id: str) -> str:
    """A token that changes whenever the user's live memory or its encodings change."""
    row = (
        await conn.execute(
            select(
                func.count(), func.max(facts.c.id), func.max(facts.c.encoded_at)
            ).where(and_(facts.c.user_id == user_id, facts.c.deleted_at.is_(None)))
        )
    ).one()
    return f"{row[0]}-{row[1]}-{row[2].timestamp() if row[2] else 0}"


async def count_user_rows(conn: AsyncConnection, user_id: str) -> tuple[int, int]:
    """(turns, facts) stored for one user."""
    n_turns = await conn.scalar(select(func.count()).where(turns.c.user_id == user_id))
    n_facts = await conn.scalar(select(func.count()).where(facts.c.user_id == user_id))
    return int(n_turns), int(n_facts)


async def delete_user(conn: AsyncConnection, user_id: str) -> list[str]:
    """Delete a user's turns and facts; returns the KV locations that must be removed too."""
    locations = (
        await conn.execute(
            delete(facts).where(facts.c.user_id == user_id).returning(facts.c.kv_location)
        )
    ).scalars().all()
    await conn.execute(delete(turns).where(turns.c.user_id == user_id))
    return [loc for loc in locations if loc]

