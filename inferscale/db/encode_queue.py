"""The encode queue in the facts table: leased claims of facts waiting for KV (or a backfill, or
a migration to another model), their outcomes fenced by claim number, retries with backoff,
quarantine of facts that kill workers. All SQL is parameterized."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import (
    TextClause,
    bindparam,
    func,
    select,
    text,
    true,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from inferscale.db.tables import facts

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
    restored: bool = False  # its KV was evicted, and a request wants it back
    replaced: str | None = None  # where its KV was: removed once replaced elsewhere

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
# have not been quarantined and whose KV was not evicted (unless a request wants it again), or
# (``backfill``) facts marked for re-encoding.
_CANDIDATES = {
    "pending": """kv_location IS NULL
              AND (kv_evicted_at IS NULL OR kv_wanted_at IS NOT NULL)
              AND (encode_attempts < :max_attempts OR encode_error LIKE :storage_failure)
              AND (encode_error IS NULL OR encode_error NOT LIKE :quarantined)""",
    "backfill": """backfill_due AND kv_location IS NOT NULL
              AND (CAST(:fingerprint AS text) IS NULL OR model_fingerprint = :fingerprint)
              AND (encode_error IS NULL OR encode_error LIKE :storage_failure)""",
    "migrate": """kv_location IS NOT NULL AND model_fingerprint IS DISTINCT FROM :fingerprint
              AND (encode_error IS NULL OR encode_error LIKE :storage_failure)""",
}

# A fact is claimable while it is a candidate, live, past its backoff and its lease, and has
# not killed max_crashes workers. ``:suspect`` selects the facts whose last claimer died
# (claims ahead of recorded outcomes), or the others. Evicted facts a request wants come first.
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
            ORDER BY kv_wanted_at IS NULL, encode_attempts, id
            LIMIT :limit
            FOR UPDATE SKIP LOCKED))
        RETURNING id, user_id, conversation_id, ts, text, embedding, encode_attempts,
                  encode_claims, kv_wanted_at IS NOT NULL AS restored, kv_location
    )
    SELECT f.id, f.user_id, f.text, f.encode_claims, f.restored, f.kv_location,
           COALESCE(ARRAY({context}), '{{}}') AS context
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
                               max_crashes: int, fingerprint: str | None = None
                               ) -> list[PendingFact]:
    """Lease up to ``limit`` facts marked for re-encoding (``mark_backfill_due``; whose KV was
    made for the model ``fingerprint``, where given), with their backfill context, as
    ``claim_pending_facts`` leases pending ones. A re-encoding that fails (other than in
    storage) is not tried again: the fact keeps the KV it has."""
    return await _claim_facts(conn, "backfill", limit, window, 0, lease_s, max_crashes,
                              "neighbours", True, fingerprint)

async def claim_migrating_facts(conn: AsyncConnection, limit: int, window: int,
                                lease_s: float, max_crashes: int, fingerprint: str,
                                context: str = "turns", backfill: bool = False
                                ) -> list[PendingFact]:
    """Lease up to ``limit`` facts whose KV was made for another model than ``fingerprint``,
    with their encoding context, as ``claim_pending_facts`` leases pending ones: a fleet moving
    to a new model encodes its memory again instead of serving it as text for good. Each comes
    with the location of the KV it replaces. A failed migration (other than in storage) is not
    tried again: the fact keeps the KV it has."""
    return await _claim_facts(conn, "migrate", limit, window, 0, lease_s, max_crashes, context,
                              backfill, fingerprint)

async def _claim_facts(conn: AsyncConnection, kind: str, limit: int, window: int,
                       max_attempts: int, lease_s: float, max_crashes: int, context: str,
                       backfill: bool, fingerprint: str | None = None) -> list[PendingFact]:
    params = {"limit": limit, "window": window, "max_attempts": max_attempts,
              "storage_failure": f"{STORAGE_FAILURE}:%", "lease_s": lease_s,
              "max_crashes": max_crashes, "quarantined": f"{QUARANTINED}:%",
              "backfill": backfill and window > 0, "fingerprint": fingerprint}
    claim = _CLAIMS[kind, context]
    rows = (await conn.execute(claim, {**params, "suspect": True, "limit": 1})).all()
    if not rows:
        rows = (await conn.execute(claim, {**params, "suspect": False})).all()
    return [PendingFact(id=r.id, user_id=r.user_id, text=r.text,
                        context=list(reversed(r.context)), claim=r.encode_claims,
                        reencode=kind == "backfill", restored=r.restored,
                        replaced=r.kv_location) for r in rows]

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

@dataclass(frozen=True)
class Recorded:
    """What ``record_encoded`` did with each row."""

    recorded: list[dict]  # stored: the fact's KV is the row's now
    gone: list[dict]  # the fact is gone (forgotten, or retired by an update): remove the blobs
    superseded: list[dict]  # claimed again since (the lease ran out): left to the newer claim


async def record_encoded(conn: AsyncConnection, rows: Sequence[dict]) -> Recorded:
    """Store KV metadata of encoded facts and end their leases. Each dict: id, claim,
    token_ids, window, context_facts, fingerprint, location, nbytes, checksum, lead_checksum
    (or None). A fact claimed again since (its lease ran out) is left to the newer claim."""
    if not rows:
        return Recorded([], [], [])
    await conn.execute(
        update(facts).where(facts.c.id == bindparam("fid"),
                            facts.c.encode_claims == bindparam("claim")).values(
            token_ids=bindparam("token_ids"), token_count=func.cardinality(bindparam("token_ids")),
            window=bindparam("window"), context_facts=bindparam("context_facts"),
            backfill_due=False, model_fingerprint=bindparam("fingerprint"),
            kv_location=bindparam("location"), kv_bytes=bindparam("nbytes"),
            kv_checksum=bindparam("checksum"),
            kv_lead_checksum=bindparam("lead_checksum"),
            encoded_at=func.clock_timestamp(), kv_evicted_at=None, kv_wanted_at=None,
            encode_error=None, retry_at=None, claimed_until=None,
            encode_attempts=facts.c.encode_attempts + 1,
        ),
        [{**r, "fid": r["id"]} for r in rows],
    )
    # The updated rows are locked now: a deletion or an update either came before (the row is
    # missing or retired here) or waits for this commit (and then removes the blob itself).
    claims = dict((await conn.execute(
        select(facts.c.id, facts.c.encode_claims).where(
            facts.c.id.in_([r["id"] for r in rows]), facts.c.deleted_at.is_(None)))).all())
    return Recorded(
        recorded=[r for r in rows if claims.get(r["id"]) == r["claim"]],
        gone=[r for r in rows if r["id"] not in claims],
        superseded=[r for r in rows if r["id"] in claims and claims[r["id"]] != r["claim"]])


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
    tried, now or after a backoff or a lease); quarantined facts are not, nor evicted facts no
    request wants."""
    mine = facts.c.user_id == user_id if user_id is not None else true()
    query = select(func.count()).where(mine,
        facts.c.kv_location.is_(None), facts.c.deleted_at.is_(None),
        facts.c.kv_evicted_at.is_(None) | facts.c.kv_wanted_at.is_not(None),
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
