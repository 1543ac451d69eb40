"""Idempotent writes and the reads the workers and the server need. All SQL is parameterized."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import (
    BigInteger,
    TextClause,
    any_,
    bindparam,
    delete,
    func,
    select,
    text,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.ext.asyncio import AsyncConnection

from inferscale.db.tables import facts, forgotten_users, memory_versions, turns


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
    kv_lead_checksum: str | None  # None: no lead blob (encoded without one)
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


async def memory_version(conn: AsyncConnection, user_id: str) -> tuple[int, int]:
    """(the owner's memory version, about how many live facts they have); any change to which
    facts are live bumps the version (migration 0008); (0, 0): never had a fact."""
    row = (await conn.execute(select(
        memory_versions.c.version, memory_versions.c.inserted - memory_versions.c.retired)
        .where(memory_versions.c.user_id == user_id))).first()
    return (int(row[0]), int(row[1])) if row else (0, 0)


async def top_k_facts(conn: AsyncConnection, user_id: str, query_embedding: Sequence[float],
                      k: int) -> list[RetrievedFact]:
    """The owner's k live facts nearest to the query, ranked by pgvector (exact: the owner's
    rows through ix_facts_user): for owners too large for a server's in-process index."""
    distance = facts.c.embedding.cosine_distance(list(query_embedding)).label("distance")
    stmt = (select(facts.c.id, facts.c.text, distance, facts.c.token_ids, facts.c.kv_location,
                   facts.c.kv_checksum, facts.c.kv_lead_checksum, facts.c.model_fingerprint)
            .where(facts.c.user_id == user_id, facts.c.deleted_at.is_(None))
            .order_by(distance, facts.c.id).limit(k))
    return [RetrievedFact(**row._mapping) for row in await conn.execute(stmt)]


@dataclass(frozen=True)
class MemoryDelta:
    """An owner's memory counters and the ids of their live facts above some id, read in one
    snapshot."""

    version: int
    inserted: int  # facts ever stored
    retired: int  # facts ever deleted, retired or revived
    ids: list[int]


_MEMORY_DELTA = text("""
    SELECT coalesce(m.version, 0) AS version, coalesce(m.inserted, 0) AS inserted,
           coalesce(m.retired, 0) AS retired,
           array(SELECT id FROM facts WHERE user_id = :user AND id > :after
                 AND deleted_at IS NULL ORDER BY id) AS ids
    FROM (SELECT 1) one LEFT JOIN memory_versions m ON m.user_id = :user
""")


async def memory_delta(conn: AsyncConnection, user_id: str, after_id: int) -> MemoryDelta:
    """The owner's memory counters and live fact ids above ``after_id`` (0: all of them)."""
    row = (await conn.execute(_MEMORY_DELTA, {"user": user_id, "after": after_id})).one()
    return MemoryDelta(int(row.version), int(row.inserted), int(row.retired), list(row.ids))


async def fact_embeddings(conn: AsyncConnection, fact_ids: Sequence[int]
                          ) -> list[tuple[int, bytes]]:
    """(id, embedding in pgvector's binary format) of these facts, in id order."""
    rows = await conn.execute(text(
        "SELECT id, vector_send(embedding) AS embedding FROM facts "
        "WHERE id = ANY(CAST(:ids AS bigint[])) ORDER BY id"), {"ids": list(fact_ids)})
    return [(r.id, bytes(r.embedding)) for r in rows]


_LIVE_FACTS = text("""
    SELECT coalesce(m.version, 0) AS version, f.id, f.text, f.token_ids, f.kv_location,
           f.kv_checksum, f.kv_lead_checksum, f.model_fingerprint
    FROM (SELECT 1) one
    LEFT JOIN memory_versions m ON m.user_id = :user
    LEFT JOIN facts f ON f.id = ANY(CAST(:ids AS bigint[])) AND f.user_id = :user
        AND f.deleted_at IS NULL
""")


async def live_facts(conn: AsyncConnection, user_id: str, fact_ids: Sequence[int]
                     ) -> tuple[int, dict[int, dict]]:
    """(the owner's memory version, their live facts among ``fact_ids`` as RetrievedFact fields
    less distance), read in one snapshot."""
    rows = (await conn.execute(_LIVE_FACTS, {"user": user_id, "ids": list(fact_ids)})).all()
    found = {row.id: {k: v for k, v in row._mapping.items() if k != "version"}
             for row in rows if row.id is not None}
    return int(rows[0].version), found


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
    # One array parameter (= ANY): an IN list binds one parameter per id, and asyncpg takes
    # at most 32,767 of them, fewer than the blobs a bucket holds.
    ids = bindparam("ids", list(fact_ids), type_=ARRAY(BigInteger))
    rows = await conn.execute(select(facts.c.id).where(facts.c.id == any_(ids)))
    return set(rows.scalars().all())


# Encode errors starting "storage:" (the durable tier failed) are retried until they clear;
# facts whose error starts "quarantined:" (they killed workers) are never claimed again.
STORAGE_FAILURE = "storage"
QUARANTINED = "quarantined"


@dataclass(frozen=True)
class PendingFact:
    """A fact waiting for its KV (or, ``reencode``, for KV after a wider context), with the
    context it is encoded after."""

    id: int
    user_id: str
    text: str
    context: list[str]  # oldest first
    claim: int  # the claim's number: only its holder records the outcome
    reencode: bool = False


# A claimed fact's encoding context, most adjacent first (the caller reverses it): the
# ``window`` facts that precede it in its conversation, or the ``window`` earlier facts of its
# user most similar to it (what tends to precede it in a served prompt, best last). With
# ``:backfill``, a fact among its user's first ``window`` facts draws them from the user's
# first 3 x ``window`` facts once there are that many (``a``, ``b``: the user's facts at those
# ranks).
_CONTEXTS = {
    "turns": """
               SELECT c.text FROM facts c
               WHERE c.user_id = f.user_id AND c.conversation_id = f.conversation_id
                 AND c.deleted_at IS NULL AND (c.ts, c.id) < (f.ts, f.id)
               ORDER BY c.ts DESC, c.id DESC LIMIT :window""",
    "neighbours": """
               SELECT c.text FROM facts c
               WHERE c.user_id = f.user_id AND c.deleted_at IS NULL AND c.id <> f.id
                 AND ((c.ts, c.id) < (f.ts, f.id)
                      OR (:backfill AND (f.ts, f.id) <= (a.ts, a.id)
                          AND (c.ts, c.id) <= (b.ts, b.id)))
               ORDER BY c.embedding <=> f.embedding, c.id LIMIT :window""",
}

# The user's live fact at a rank (0: the first), by (ts, id).
_RANKED = """LEFT JOIN LATERAL (SELECT r.ts, r.id FROM facts r
                 WHERE r.user_id = f.user_id AND r.deleted_at IS NULL
                 ORDER BY r.ts, r.id OFFSET {rank} LIMIT 1) {alias} ON true"""

# Which facts a claim takes: facts waiting for KV with attempts (or storage retries) left that
# have not been quarantined, or (``backfill``) facts marked for re-encoding.
_CANDIDATES = {
    "pending": """kv_location IS NULL
              AND (encode_attempts < :max_attempts OR encode_error LIKE :storage_failure)
              AND (encode_error IS NULL OR encode_error NOT LIKE :quarantined)""",
    "backfill": """backfill_due AND kv_location IS NOT NULL
              AND (encode_error IS NULL OR encode_error LIKE :storage_failure)""",
}

# A fact is claimable while it is a candidate, live, past its backoff and its lease, and has
# not killed max_crashes workers. ``:suspect`` selects the facts whose last claimer died
# (claims ahead of recorded outcomes), or the others.
_CLAIM = """
    WITH claimed AS (
        UPDATE facts SET encode_claims = encode_claims + 1,
                         claimed_until = now() + make_interval(secs => :lease_s)
        WHERE id = ANY(ARRAY(
            SELECT id FROM facts
            WHERE {candidates} AND deleted_at IS NULL
              AND (retry_at IS NULL OR retry_at <= now())
              AND (claimed_until IS NULL OR claimed_until <= now())
              AND encode_claims - encode_attempts < :max_crashes
              AND (encode_claims > encode_attempts) = :suspect
            ORDER BY encode_attempts, id
            LIMIT :limit
            FOR UPDATE SKIP LOCKED))
        RETURNING id, user_id, conversation_id, ts, text, embedding, encode_attempts,
                  encode_claims
    )
    SELECT f.id, f.user_id, f.text, f.encode_claims, COALESCE(ARRAY({context}), '{{}}') AS context
    FROM claimed f {ranked_a} {ranked_b}
    ORDER BY f.encode_attempts, f.id
"""


def _claim(candidates: str, context: str) -> TextClause:
    return text(_CLAIM.format(candidates=_CANDIDATES[candidates], context=_CONTEXTS[context],
                              ranked_a=_RANKED.format(rank="GREATEST(:window - 1, 0)", alias="a"),
                              ranked_b=_RANKED.format(rank="GREATEST(3 * :window - 1, 0)",
                                                      alias="b")))


_CLAIMS = {(kind, context): _claim(kind, context) for kind in _CANDIDATES for context in _CONTEXTS}


async def claim_pending_facts(conn: AsyncConnection, limit: int, window: int, max_attempts: int,
                              lease_s: float, max_crashes: int, context: str = "turns",
                              backfill: bool = False) -> list[PendingFact]:
    """Lease up to ``limit`` pending facts for ``lease_s`` seconds and count the claims, with
    their encoding context, most adjacent last: the ``window`` preceding facts of the same
    conversation (``turns``) or the ``window`` earlier facts of the user most similar to it
    (``neighbours``; with ``backfill``, a fact among its user's first ``window`` draws them from
    the user's first 3 x ``window`` once there are that many).

    Commit at once: the lease, not a lock held while encoding, keeps other workers off the
    facts, so a worker that dies while encoding leaves its claims counted. A fact whose last
    claimer died is claimed alone, so a fact that kills workers takes no batch-mates with it.
    """
    return await _claim_facts(conn, "pending", limit, window, max_attempts, lease_s,
                              max_crashes, context, backfill)


async def claim_backfill_facts(conn: AsyncConnection, limit: int, window: int, lease_s: float,
                               max_crashes: int) -> list[PendingFact]:
    """Lease up to ``limit`` facts marked for re-encoding (``mark_backfill_due``), with their
    backfill context, as ``claim_pending_facts`` leases pending ones. A re-encoding that fails
    (other than in storage) is not tried again: the fact keeps the KV it has."""
    return await _claim_facts(conn, "backfill", limit, window, 0, lease_s, max_crashes,
                              "neighbours", True)


async def _claim_facts(conn: AsyncConnection, kind: str, limit: int, window: int,
                       max_attempts: int, lease_s: float, max_crashes: int, context: str,
                       backfill: bool) -> list[PendingFact]:
    params = {"limit": limit, "window": window, "max_attempts": max_attempts,
              "storage_failure": f"{STORAGE_FAILURE}:%", "lease_s": lease_s,
              "max_crashes": max_crashes, "quarantined": f"{QUARANTINED}:%",
              "backfill": backfill and window > 0}
    claim = _CLAIMS[kind, context]
    rows = (await conn.execute(claim, {**params, "suspect": True, "limit": 1})).all()
    if not rows:
        rows = (await conn.execute(claim, {**params, "suspect": False})).all()
    return [PendingFact(id=r.id, user_id=r.user_id, text=r.text,
                        context=list(reversed(r.context)), claim=r.encode_claims,
                        reencode=kind == "backfill") for r in rows]


_MARK_BACKFILL = text("""
    UPDATE facts e SET backfill_due = true
    FROM (SELECT user_id FROM facts WHERE user_id = ANY(:users) AND deleted_at IS NULL
          GROUP BY user_id HAVING count(*) >= 3 * :window) u
    WHERE e.user_id = u.user_id AND e.deleted_at IS NULL AND e.kv_location IS NOT NULL
      AND e.context_facts < :window AND NOT e.backfill_due
""")


async def mark_backfill_due(conn: AsyncConnection, user_ids: Sequence[str], window: int) -> int:
    """Mark for re-encoding the facts of these users encoded after fewer than ``window`` facts,
    for users who now have 3 x ``window`` live facts; returns how many were marked."""
    if window <= 0 or not user_ids:
        return 0
    return (await conn.execute(_MARK_BACKFILL, {"users": sorted(set(user_ids)),
                                                "window": window})).rowcount


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
    token_ids, window, context_facts, fingerprint, location, nbytes, checksum, lead_checksum
    (or None). A fact claimed again since (its lease ran out) is left to the newer claim.
    Returns the rows whose fact is gone (its user was forgotten, or the fact retired by an
    update, while it was encoded): their blobs must be removed."""
    if not rows:
        return []
    await conn.execute(
        update(facts).where(facts.c.id == bindparam("fid"),
                            facts.c.encode_claims == bindparam("claim")).values(
            token_ids=bindparam("token_ids"), token_count=func.cardinality(bindparam("token_ids")),
            window=bindparam("window"), context_facts=bindparam("context_facts"),
            backfill_due=False, model_fingerprint=bindparam("fingerprint"),
            kv_location=bindparam("location"), kv_bytes=bindparam("nbytes"),
            kv_checksum=bindparam("checksum"),
            kv_lead_checksum=bindparam("lead_checksum"),
            encoded_at=func.clock_timestamp(),
            encode_error=None, retry_at=None, claimed_until=None,
            encode_attempts=facts.c.encode_attempts + 1,
        ),
        [{**r, "fid": r["id"]} for r in rows],
    )
    # The updated rows are locked now: a deletion or an update either came before (the row is
    # missing or retired here) or waits for this commit (and then removes the blob itself).
    present = set((await conn.execute(
        select(facts.c.id).where(facts.c.id.in_([r["id"] for r in rows]),
                                 facts.c.deleted_at.is_(None)))).scalars())
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


async def count_pending_facts(conn: AsyncConnection, max_attempts: int, max_crashes: int,
                              user_id: str | None = None) -> int:
    """Facts (of every user, or of ``user_id``) still waiting for their KV (and still to be
    tried, now or after a backoff or a lease); quarantined facts are not."""
    mine = facts.c.user_id == user_id if user_id is not None else true()
    query = select(func.count()).where(mine,
        facts.c.kv_location.is_(None), facts.c.deleted_at.is_(None),
        facts.c.encode_claims - facts.c.encode_attempts < max_crashes,
        facts.c.encode_error.is_(None) | facts.c.encode_error.not_like(f"{QUARANTINED}:%"),
        (facts.c.encode_attempts < max_attempts)
        | facts.c.encode_error.like(f"{STORAGE_FAILURE}:%"))
    return (await conn.execute(query)).scalar_one()


async def count_backfill_facts(conn: AsyncConnection, max_crashes: int,
                               user_id: str | None = None) -> int:
    """Facts (of every user, or of ``user_id``) marked for re-encoding and still to be tried."""
    mine = facts.c.user_id == user_id if user_id is not None else true()
    query = select(func.count()).where(mine,
        facts.c.backfill_due, facts.c.kv_location.is_not(None), facts.c.deleted_at.is_(None),
        facts.c.encode_claims - facts.c.encode_attempts < max_crashes,
        facts.c.encode_error.is_(None) | facts.c.encode_error.like(f"{STORAGE_FAILURE}:%"))
    return (await conn.execute(query)).scalar_one()


@dataclass(frozen=True)
class ClaimedTurn:
    """A stored turn leased to the extract stage, with the turns that preceded it."""

    user_id: str
    conversation_id: str
    turn_id: str
    speaker: str
    text: str
    ts: datetime
    claim: int  # the claim's number: only its holder records the turn's facts
    context: list[str]  # "<speaker>: <text>" of the preceding turns, oldest first


# Claims are serialised by one transaction-scoped advisory lock, so two workers never lease
# turns of the same user at once: a user's facts are decided against each other in turn order.
_EXTRACT_CLAIM_LOCK = 0x1E57AC7
_CLAIM_TURNS = text("""
    WITH users AS (
        SELECT user_id, row_number() OVER (ORDER BY min(created_at), user_id) AS rank
        FROM turns WHERE extracted_at IS NULL
        GROUP BY user_id
        HAVING bool_and(extract_until IS NULL OR extract_until <= now())
        ORDER BY rank LIMIT :limit
    ), picked AS (
        SELECT t.user_id, t.conversation_id, t.turn_id FROM turns t JOIN users USING (user_id)
        WHERE t.extracted_at IS NULL
        ORDER BY users.rank, t.ts, t.turn_id LIMIT :limit
        FOR UPDATE OF t SKIP LOCKED
    ), claimed AS (
        UPDATE turns t SET extract_claims = t.extract_claims + 1,
                           extract_until = now() + make_interval(secs => :lease_s)
        FROM picked p
        WHERE (t.user_id, t.conversation_id, t.turn_id)
            = (p.user_id, p.conversation_id, p.turn_id)
        RETURNING t.user_id, t.conversation_id, t.turn_id, t.speaker, t.text, t.ts,
                  t.extract_claims
    )
    SELECT t.*, COALESCE(ARRAY(
        SELECT c.speaker || ': ' || c.text FROM turns c
        WHERE c.user_id = t.user_id AND c.conversation_id = t.conversation_id
          AND (c.ts, c.turn_id) < (t.ts, t.turn_id)
        ORDER BY c.ts DESC, c.turn_id DESC LIMIT :context), '{}') AS context
    FROM claimed t
    ORDER BY t.user_id, t.ts, t.turn_id
""")


async def claim_unextracted_turns(conn: AsyncConnection, limit: int, lease_s: float,
                                  context: int) -> list[ClaimedTurn]:
    """Lease up to ``limit`` unextracted turns for ``lease_s`` seconds, user by user (oldest
    backlog first), of users no other worker holds a lease on, each with its ``context``
    preceding turns. Commit at once."""
    await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _EXTRACT_CLAIM_LOCK})
    rows = await conn.execute(_CLAIM_TURNS, {"limit": limit, "lease_s": lease_s,
                                             "context": context})
    return [ClaimedTurn(user_id=r.user_id, conversation_id=r.conversation_id, turn_id=r.turn_id,
                        speaker=r.speaker, text=r.text, ts=r.ts, claim=r.extract_claims,
                        context=list(reversed(r.context))) for r in rows]


@dataclass(frozen=True)
class StoredFact:
    """A live fact, as the update step compares new facts with it."""

    id: int
    text: str
    embedding: list[float]


async def nearest_live_facts(conn: AsyncConnection, user_id: str,
                             embeddings: Sequence[Sequence[float]], n: int
                             ) -> list[list[StoredFact]]:
    """For each embedding, the user's ``n`` live facts nearest to it (exact, nearest first)."""
    if not embeddings or n <= 0:
        return [[] for _ in embeddings]
    rows = await conn.execute(text("""
        SELECT q.i, f.id, f.text, f.embedding::text AS embedding
        FROM unnest(CAST(:vectors AS text[])) WITH ORDINALITY AS q(v, i)
        CROSS JOIN LATERAL (
            SELECT id, text, embedding FROM facts
            WHERE user_id = :user AND deleted_at IS NULL
            ORDER BY embedding <=> CAST(q.v AS vector), id LIMIT :n) f
        ORDER BY q.i, (f.embedding <=> CAST(q.v AS vector)), f.id
    """), {"vectors": [_vector_text(e) for e in embeddings], "user": user_id, "n": n})
    out: list[list[StoredFact]] = [[] for _ in embeddings]
    for r in rows:
        out[r.i - 1].append(StoredFact(r.id, r.text, json.loads(r.embedding)))
    return out


def _vector_text(values: Sequence[float]) -> str:
    return "[" + ",".join(repr(float(x)) for x in values) + "]"


@dataclass(frozen=True)
class Retirement:
    """An existing fact of ``user_id`` an update removes: deleted, or superseded by the new
    fact at index ``by`` of the facts stored with it."""

    user_id: str
    fact_id: int
    by: int | None = None


_MARK_EXTRACTED = text("""
    UPDATE turns t SET extracted_at = clock_timestamp(), extract_until = NULL
    FROM unnest(CAST(:users AS text[]), CAST(:conversations AS text[]),
                CAST(:turn_ids AS text[]), CAST(:claims AS int[])) AS k(u, c, t, claim)
    WHERE (t.user_id, t.conversation_id, t.turn_id) = (k.u, k.c, k.t)
      AND t.extract_claims = k.claim AND t.extracted_at IS NULL
    RETURNING t.user_id, t.conversation_id, t.turn_id
""")
_RETIRE = text("""
    UPDATE facts f SET deleted_at = clock_timestamp(), superseded_by = r.by
    FROM unnest(CAST(:ids AS bigint[]), CAST(:bys AS bigint[]), CAST(:users AS text[]))
        AS r(id, by, user_id)
    WHERE f.id = r.id AND f.user_id = r.user_id AND f.deleted_at IS NULL
    RETURNING f.user_id, f.kv_location
""")


async def record_extraction(conn: AsyncConnection, claimed: Sequence[ClaimedTurn],
                            new_facts: Sequence[NewFact], retired: Sequence[Retirement]
                            ) -> tuple[int, list[tuple[str, str | None]]]:
    """Store the facts extracted from claimed turns, retire the facts they replace (history
    kept: ``deleted_at``, ``superseded_by``) and mark the turns extracted, for the turns whose
    claim is still held (a turn forgotten or re-leased meanwhile contributes nothing).
    Returns the number of facts stored and (user, KV location or None) per retired fact: the
    blobs to remove from every tier."""
    if not claimed:
        return 0, []
    await lock_users(conn, [t.user_id for t in claimed], exclusive=False)
    held = {tuple(r) for r in await conn.execute(_MARK_EXTRACTED, {
        "users": [t.user_id for t in claimed],
        "conversations": [t.conversation_id for t in claimed],
        "turn_ids": [t.turn_id for t in claimed], "claims": [t.claim for t in claimed]})}
    keep = [i for i, f in enumerate(new_facts)
            if all((f.user_id, f.conversation_id, t) in held for t in f.turn_ids)]
    ids: dict[int, int] = {}
    if keep:
        values = [{**new_facts[i].__dict__, "turn_ids": list(new_facts[i].turn_ids),
                   "embedding": list(new_facts[i].embedding)} for i in keep]
        inserted = await conn.execute(
            insert(facts).values(values).on_conflict_do_nothing(constraint="uq_facts_source")
            .returning(facts.c.id, facts.c.turn_ids, facts.c.ordinal))
        by_source = {(tuple(r.turn_ids), r.ordinal): r.id for r in inserted}
        ids = {i: by_source[key] for i in keep
               if (key := (tuple(new_facts[i].turn_ids), new_facts[i].ordinal)) in by_source}
    users = {user for user, _, _ in held}
    applied = [r for r in retired
               if r.user_id in users and (r.by is None or r.by in ids)]  # else keep the old fact
    if not applied:
        return len(ids), []
    rows = await conn.execute(_RETIRE, {
        "ids": [r.fact_id for r in applied], "users": [r.user_id for r in applied],
        "bys": [ids[r.by] if r.by is not None else None for r in applied]})
    return len(ids), [(r.user_id, r.kv_location) for r in rows]


async def count_unextracted_turns(conn: AsyncConnection) -> int:
    """Turns whose facts are not extracted yet."""
    query = select(func.count()).where(turns.c.extracted_at.is_(None))
    return (await conn.execute(query)).scalar_one()
