"""Idempotent writes and the reads the workers and the server need. All SQL is parameterized."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, bindparam, delete, func, select, text, update
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


async def existing_fact_ids(conn: AsyncConnection, fact_ids: Sequence[int]) -> set[int]:
    """Which of these fact ids still have a row."""
    if not fact_ids:
        return set()
    rows = await conn.execute(select(facts.c.id).where(facts.c.id.in_(list(fact_ids))))
    return set(rows.scalars().all())


# Encode errors starting "storage:" (the durable tier failed) are retried until they clear;
# facts whose error starts "quarantined:" (they killed workers) are never claimed again.
STORAGE_FAILURE = "storage"
QUARANTINED = "quarantined"


@dataclass(frozen=True)
class PendingFact:
    """A fact waiting for its KV, with the conversation context that preceded it."""

    id: int
    text: str
    context: list[str]  # oldest first
    claim: int  # the claim's number: only its holder records the outcome


# A fact is claimable while it waits for KV, has attempts (or storage retries) left, is past its
# backoff and its lease, and has not killed max_crashes workers. ``:suspect`` selects the facts
# whose last claimer died (claims ahead of recorded outcomes), or the others.
# A claimed fact's encoding context, most adjacent first (the caller reverses it): the
# ``window`` facts that precede it in its conversation, or the ``window`` earlier facts of its
# user most similar to it (what tends to precede it in a served prompt, best last).
_CONTEXTS = {
    "turns": """
               SELECT c.text FROM facts c
               WHERE c.user_id = f.user_id AND c.conversation_id = f.conversation_id
                 AND c.deleted_at IS NULL AND (c.ts, c.id) < (f.ts, f.id)
               ORDER BY c.ts DESC, c.id DESC LIMIT :window""",
    "neighbours": """
               SELECT c.text FROM facts c
               WHERE c.user_id = f.user_id AND c.deleted_at IS NULL
                 AND (c.ts, c.id) < (f.ts, f.id)
               -- "+ 0" keeps the planner off the HNSW index: an index scan filtered by user
               -- afterwards would drop neighbours; the exact sort covers one user's facts.
               ORDER BY (c.embedding <=> f.embedding) + 0, c.id LIMIT :window""",
}

_CLAIM = """
    WITH claimed AS (
        UPDATE facts SET encode_claims = encode_claims + 1,
                         claimed_until = now() + make_interval(secs => :lease_s)
        WHERE id = ANY(ARRAY(
            SELECT id FROM facts
            WHERE kv_location IS NULL AND deleted_at IS NULL
              AND (encode_attempts < :max_attempts OR encode_error LIKE :storage_failure)
              AND (retry_at IS NULL OR retry_at <= now())
              AND (claimed_until IS NULL OR claimed_until <= now())
              AND encode_claims - encode_attempts < :max_crashes
              AND (encode_error IS NULL OR encode_error NOT LIKE :quarantined)
              AND (encode_claims > encode_attempts) = :suspect
            ORDER BY encode_attempts, id
            LIMIT :limit
            FOR UPDATE SKIP LOCKED))
        RETURNING id, user_id, conversation_id, ts, text, embedding, encode_attempts,
                  encode_claims
    )
    SELECT f.id, f.text, f.encode_claims, COALESCE(ARRAY({context}), '{{}}') AS context
    FROM claimed f
    ORDER BY f.encode_attempts, f.id
"""
_CLAIMS = {name: text(_CLAIM.format(context=sql)) for name, sql in _CONTEXTS.items()}


async def claim_pending_facts(conn: AsyncConnection, limit: int, window: int, max_attempts: int,
                              lease_s: float, max_crashes: int, context: str = "turns"
                              ) -> list[PendingFact]:
    """Lease up to ``limit`` pending facts for ``lease_s`` seconds and count the claims, with
    their encoding context, most adjacent last: the ``window`` preceding facts of the same
    conversation (``turns``) or the ``window`` earlier facts of the user most similar to it
    (``neighbours``).

    Commit at once: the lease, not a lock held while encoding, keeps other workers off the
    facts, so a worker that dies while encoding leaves its claims counted. A fact whose last
    claimer died is claimed alone, so a fact that kills workers takes no batch-mates with it.
    """
    params = {"limit": limit, "window": window, "max_attempts": max_attempts,
              "storage_failure": f"{STORAGE_FAILURE}:%", "lease_s": lease_s,
              "max_crashes": max_crashes, "quarantined": f"{QUARANTINED}:%"}
    claim = _CLAIMS[context]
    rows = (await conn.execute(claim, {**params, "suspect": True, "limit": 1})).all()
    if not rows:
        rows = (await conn.execute(claim, {**params, "suspect": False})).all()
    return [PendingFact(id=r.id, text=r.text, context=list(reversed(r.context)),
                        claim=r.encode_claims) for r in rows]


async def quarantine_crashed_facts(conn: AsyncConnection, max_crashes: int) -> list[int]:
    """Give up on facts whose encoding killed ``max_crashes`` workers (their last lease ran
    out without an outcome): they are never claimed again (even with a larger budget) and are
    served as text. Returns their ids."""
    crashes = facts.c.encode_claims - facts.c.encode_attempts
    return list((await conn.execute(
        update(facts)
        .where(facts.c.claimed_until <= func.now(), facts.c.kv_location.is_(None),
               facts.c.deleted_at.is_(None), crashes >= max_crashes)
        .values(claimed_until=None, encode_error=func.concat(
            f"{QUARANTINED}: worker died ", crashes, " times while encoding it"))
        .returning(facts.c.id))).scalars())


async def record_encoded(conn: AsyncConnection, rows: Sequence[dict]) -> list[dict]:
    """Store KV metadata of encoded facts and end their leases. Each dict: id, claim,
    token_ids, window, fingerprint, location, nbytes, checksum. A fact claimed again since
    (its lease ran out) is left to the newer claim. Returns the rows whose fact is gone (its
    user was forgotten while it was encoded): their blobs must be removed."""
    if not rows:
        return []
    await conn.execute(
        update(facts).where(facts.c.id == bindparam("fid"),
                            facts.c.encode_claims == bindparam("claim")).values(
            token_ids=bindparam("token_ids"), token_count=func.cardinality(bindparam("token_ids")),
            window=bindparam("window"), model_fingerprint=bindparam("fingerprint"),
            kv_location=bindparam("location"), kv_bytes=bindparam("nbytes"),
            kv_checksum=bindparam("checksum"), encoded_at=func.clock_timestamp(),
            encode_error=None, retry_at=None, claimed_until=None,
            encode_attempts=facts.c.encode_attempts + 1,
        ),
        [{**r, "fid": r["id"]} for r in rows],
    )
    # The updated rows are locked now: a deletion either came before (the row is missing
    # here) or waits for this commit (and then removes the blob itself).
    present = set((await conn.execute(
        select(facts.c.id).where(facts.c.id.in_([r["id"] for r in rows])))).scalars())
    return [r for r in rows if r["id"] not in present]


async def record_encode_failure(conn: AsyncConnection, fact: PendingFact, error: str,
                                base_s: float, max_s: float) -> None:
    """Count a failed encode attempt of a claim still held, keep its reason and schedule the
    retry after an exponential backoff (``base_s * 2**attempts``, at most ``max_s``)."""
    backoff = func.least(base_s * func.power(2, facts.c.encode_attempts), max_s)
    await conn.execute(update(facts).where(
        facts.c.id == fact.id, facts.c.encode_claims == fact.claim).values(
        encode_attempts=facts.c.encode_attempts + 1, encode_error=error[:2000],
        claimed_until=None, retry_at=func.now() + func.make_interval(0, 0, 0, 0, 0, 0, backoff)))


async def count_pending_facts(conn: AsyncConnection, max_attempts: int, max_crashes: int) -> int:
    """Facts still waiting for their KV (and still to be tried, now or after a backoff or a
    lease); quarantined facts are not."""
    return int(await conn.scalar(select(func.count()).where(
        facts.c.kv_location.is_(None), facts.c.deleted_at.is_(None),
        facts.c.encode_claims - facts.c.encode_attempts < max_crashes,
        facts.c.encode_error.is_(None) | facts.c.encode_error.not_like(f"{QUARANTINED}:%"),
        (facts.c.encode_attempts < max_attempts)
        | facts.c.encode_error.like(f"{STORAGE_FAILURE}:%"))))
