"""Idempotent writes and the reads the workers and the server need. All SQL is parameterized."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, bindparam, delete, func, select, text, update
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



# Encode errors starting "storage:" (the durable tier failed) are retried until they clear.
STORAGE_FAILURE = "storage"


@dataclass(frozen=True)
class PendingFact:
    """A fact waiting for its KV, with the conversation context that preceded it."""

    id: int
    text: str
    context: list[str]  # oldest first


async def claim_pending_facts(conn: AsyncConnection, limit: int, window: int,
                              max_attempts: int) -> list[PendingFact]:
    """Lock up to ``limit`` unencoded facts (skipping ones other workers hold) with context.

    The context is the ``window`` facts of the same conversation that precede each fact.
    """
    rows = (await conn.execute(text("""
        SELECT f.id, f.text,
               COALESCE(ARRAY(
                   SELECT c.text FROM facts c
                   WHERE c.user_id = f.user_id AND c.conversation_id = f.conversation_id
                     AND c.deleted_at IS NULL AND (c.ts, c.id) < (f.ts, f.id)
                   ORDER BY c.ts DESC, c.id DESC LIMIT :window), '{}') AS context
        FROM facts f
        WHERE f.kv_location IS NULL AND f.deleted_at IS NULL
          AND (f.encode_attempts < :max_attempts OR f.encode_error LIKE :storage_failure)
          AND (f.retry_at IS NULL OR f.retry_at <= now())
        ORDER BY f.encode_attempts, f.id
        LIMIT :limit
        FOR UPDATE OF f SKIP LOCKED
    """), {"limit": limit, "window": window, "max_attempts": max_attempts,
          "storage_failure": f"{STORAGE_FAILURE}:%"})).all()
    return [PendingFact(id=r.id, text=r.text, context=list(reversed(r.context))) for r in rows]


async def record_encoded(conn: AsyncConnection, rows: Sequence[dict]) -> None:
    """Store KV metadata of encoded facts. Each dict: id, token_ids, window, fingerprint,
    location, nbytes, checksum."""
    if not rows:
        return
    await conn.execute(
        update(facts).where(facts.c.id == bindparam("fid")).values(
            token_ids=bindparam("token_ids"), token_count=func.cardinality(bindparam("token_ids")),
            window=bindparam("window"), model_fingerprint=bindparam("fingerprint"),
            kv_location=bindparam("location"), kv_bytes=bindparam("nbytes"),
            kv_checksum=bindparam("checksum"), encoded_at=func.clock_timestamp(),
            encode_error=None, retry_at=None,
            encode_attempts=facts.c.encode_attempts + 1,
        ),
        [{**r, "fid": r["id"]} for r in rows],
    )


async def record_encode_failure(conn: AsyncConnection, fact_id: int, error: str,
                                base_s: float, max_s: float) -> None:
    """Count a failed encode attempt, keep its reason and schedule the retry after an
    exponential backoff (``base_s * 2**attempts``, at most ``max_s``)."""
    backoff = func.least(base_s * func.power(2, facts.c.encode_attempts), max_s)
    await conn.execute(update(facts).where(facts.c.id == fact_id).values(
        encode_attempts=facts.c.encode_attempts + 1, encode_error=error[:2000],
        retry_at=func.now() + func.make_interval(0, 0, 0, 0, 0, 0, backoff)))


async def count_pending_facts(conn: AsyncConnection, max_attempts: int) -> int:
    """Facts still waiting for their KV (and still to be tried, now or after a backoff)."""
    return int(await conn.scalar(select(func.count()).where(
        facts.c.kv_location.is_(None), facts.c.deleted_at.is_(None),
        (facts.c.encode_attempts < max_attempts)
        | facts.c.encode_error.like(f"{STORAGE_FAILURE}:%"))))
