"""The encode queue in ``fact_kv``: per model, leased claims of facts waiting for its KV (or a
backfill), their outcomes fenced by claim number, retries with backoff, quarantine of facts that
kill workers; the registration of a model (every live fact gets a row for it). All SQL is
parameterized.

Invariants: a row's outcome is recorded only by the holder of its latest claim; recording
locks the fact's row first, so a concurrent retirement either came before (the outcome is
``gone``) or waits for the commit and then sees the new KV (``memory_edits``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from sqlalchemy import (
    TextClause,
    bindparam,
    func,
    select,
    text,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from inferscale.contracts.blob_name import FactId
from inferscale.db.tables import fact_kv, facts, kv_models

# Encode errors starting "storage:" (the durable tier failed) are retried until they clear;
# facts whose error starts "quarantined:" (they killed workers) are never claimed again.
STORAGE_FAILURE = "storage"

QUARANTINED = "quarantined"

@dataclass(frozen=True)
class PendingFact:
    """A fact waiting for its KV (or, ``reencode``, for KV after a wider context), with the
    context it is encoded after."""

    id: FactId
    user_id: str
    text: str
    context: list[str]  # oldest first
    claim: int  # the claim's number: only its holder records the outcome
    reencode: bool = False
    restored: bool = False  # its KV was evicted, and a request wants it back

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

# Which rows a claim takes: facts waiting for the model's KV with attempts (or storage retries)
# left that have not been quarantined and whose KV was not evicted (unless a request wants it
# again), or (``backfill``) facts marked for re-encoding.
_CANDIDATES = {
    "pending": """k.kv_location IS NULL
              AND (k.kv_evicted_at IS NULL OR k.kv_wanted_at IS NOT NULL)
              AND (k.encode_attempts < :max_attempts OR k.encode_error LIKE :storage_failure)
              AND (k.encode_error IS NULL OR k.encode_error NOT LIKE :quarantined)""",
    "backfill": """k.backfill_due AND k.kv_location IS NOT NULL
              AND (k.encode_error IS NULL OR k.encode_error LIKE :storage_failure)""",
}

# A row is claimable while it is a candidate, its fact live, past its backoff and its lease, and
# it has not killed max_crashes workers. ``:suspect`` selects the rows whose last claimer died
# (claims ahead of recorded outcomes), or the others. Evicted facts a request wants come first,
# facts enrolled with their model (a fleet's new model) after its fresh ones.
_CLAIM = """
    WITH claimed AS (
        UPDATE fact_kv u SET encode_claims = u.encode_claims + 1,
                             claimed_until = now() + make_interval(secs => :lease_s)
        FROM facts g
        WHERE g.id = u.fact_id AND u.model_fingerprint = :fingerprint
          AND u.fact_id = ANY(ARRAY(
            SELECT k.fact_id FROM fact_kv k JOIN facts f ON f.id = k.fact_id
            WHERE k.model_fingerprint = :fingerprint AND {candidates} AND f.deleted_at IS NULL
              AND (k.retry_at IS NULL OR k.retry_at <= now())
              AND (k.claimed_until IS NULL OR k.claimed_until <= now())
              AND k.encode_claims - k.encode_attempts < :max_crashes
              AND (k.encode_claims > k.encode_attempts) = :suspect
            ORDER BY k.kv_wanted_at IS NULL, k.enrolled, k.encode_attempts, k.fact_id
            LIMIT :limit
            FOR UPDATE OF k SKIP LOCKED))
        RETURNING g.id, g.user_id, g.conversation_id, g.ts, g.text, g.embedding,
                  u.encode_attempts, u.encode_claims, u.kv_wanted_at IS NOT NULL AS restored
    )
    SELECT f.id, f.user_id, f.text, f.encode_claims, f.restored,
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

async def register_model(conn: AsyncConnection, fingerprint: str) -> int:
    """Register the model ``fingerprint`` for encoding, once: every live fact gets a row for it
    (``enrolled``: claimed after fresh facts), as every fact inserted later does. Returns how
    many facts were enrolled (0: registered before).

    Facts are locked against inserts while enrolling, so none committed meanwhile misses its
    row (the trigger of an insert that began earlier would not see the new model)."""
    if (await conn.execute(select(kv_models.c.fingerprint).where(
            kv_models.c.fingerprint == fingerprint))).first():
        return 0
    await conn.execute(text("LOCK TABLE facts IN SHARE MODE"))
    added = await conn.execute(insert(kv_models).values(fingerprint=fingerprint)
                               .on_conflict_do_nothing().returning(kv_models.c.fingerprint))
    if added.first() is None:
        return 0
    return (await conn.execute(text(
        "INSERT INTO fact_kv (model_fingerprint, fact_id, enrolled) "
        "SELECT :fingerprint, id, true FROM facts WHERE deleted_at IS NULL "
        "ON CONFLICT DO NOTHING"), {"fingerprint": fingerprint})).rowcount


async def claim_pending_facts(conn: AsyncConnection, fingerprint: str, limit: int, window: int,
                              max_attempts: int, lease_s: float, max_crashes: int,
                              context: str = "turns", backfill: bool = False
                              ) -> list[PendingFact]:
    """Lease up to ``limit`` facts waiting for the KV of model ``fingerprint`` for ``lease_s``
    seconds and count the claims, with their encoding context, most adjacent last: the
    ``window`` preceding facts of the same conversation (``turns``) or the ``window`` earlier
    facts of the user most similar to it (``neighbours``; with ``backfill``, a fact among its
    user's first ``window`` draws them from the user's first 3 x ``window`` once there are that
    many).

    Commit at once: the lease, not a lock held while encoding, keeps other workers off the
    facts, so a worker that dies while encoding leaves its claims counted. A fact whose last
    claimer died is claimed alone, so a fact that kills workers takes no batch-mates with it.
    """
    return await _claim_facts(conn, "pending", fingerprint, limit, window, max_attempts,
                              lease_s, max_crashes, context, backfill)

async def claim_backfill_facts(conn: AsyncConnection, fingerprint: str, limit: int, window: int,
                               lease_s: float, max_crashes: int) -> list[PendingFact]:
    """Lease up to ``limit`` facts marked for re-encoding for model ``fingerprint``
    (``mark_backfill_due``), with their backfill context, as ``claim_pending_facts`` leases
    pending ones. A re-encoding that fails (other than in storage) is not tried again: the fact
    keeps the KV it has."""
    return await _claim_facts(conn, "backfill", fingerprint, limit, window, 0, lease_s,
                              max_crashes, "neighbours", True)

async def _claim_facts(conn: AsyncConnection, kind: str, fingerprint: str, limit: int,
                       window: int, max_attempts: int, lease_s: float, max_crashes: int,
                       context: str, backfill: bool) -> list[PendingFact]:
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
                        reencode=kind == "backfill", restored=r.restored) for r in rows]

_MARK_BACKFILL = text("""
    UPDATE fact_kv k SET backfill_due = true
    FROM facts e, (SELECT user_id FROM facts WHERE user_id = ANY(:users) AND deleted_at IS NULL
                   GROUP BY user_id HAVING count(*) >= 3 * :window) u
    WHERE k.model_fingerprint = :fingerprint AND k.fact_id = e.id AND e.user_id = u.user_id
      AND e.deleted_at IS NULL AND k.kv_location IS NOT NULL
      AND k.context_facts < :window AND NOT k.backfill_due
""")

async def mark_backfill_due(conn: AsyncConnection, fingerprint: str, user_ids: Sequence[str],
                            window: int) -> int:
    """Mark for re-encoding for model ``fingerprint`` the facts of these users encoded after
    fewer than ``window`` facts, for users who now have 3 x ``window`` live facts; returns how
    many were marked."""
    if window <= 0 or not user_ids:
        return 0
    return (await conn.execute(_MARK_BACKFILL, {"users": sorted(set(user_ids)),
                                                "window": window,
                                                "fingerprint": fingerprint})).rowcount

def _live(fingerprint: str):
    """Conditions: the row is the model's, and its fact is live."""
    return (fact_kv.c.model_fingerprint == fingerprint, facts.c.id == fact_kv.c.fact_id,
            facts.c.deleted_at.is_(None))

async def quarantine_crashed_facts(conn: AsyncConnection, fingerprint: str,
                                   max_crashes: int) -> list[int]:
    """Give up on facts whose encoding for model ``fingerprint`` killed ``max_crashes`` workers
    (their last lease ran out without an outcome): they are never claimed again (even with a
    larger budget) and are served as text. Returns their ids."""
    crashes = fact_kv.c.encode_claims - fact_kv.c.encode_attempts
    return list((await conn.execute(
        update(fact_kv)
        .where(*_live(fingerprint), fact_kv.c.claimed_until <= func.now(),
               fact_kv.c.kv_location.is_(None), crashes >= max_crashes)
        .values(claimed_until=None, encode_error=func.concat(
            f"{QUARANTINED}: worker died ", crashes, " times while encoding it"))
        .returning(fact_kv.c.fact_id))).scalars())

@dataclass(frozen=True)
class EncodedFact:
    """One fact's KV as an encode stage stored it: what ``record_encoded`` records."""

    id: FactId
    claim: int  # the claim it was encoded under (a newer claim wins)
    fingerprint: str  # the model's
    token_ids: list[int]
    window: int
    context_facts: int | None  # facts it was encoded after (None: never backfilled)
    location: str  # its blob
    nbytes: int  # its blob's and its lead blob's bytes
    checksum: str
    lead_checksum: str | None
    reencode: bool = False  # encoded again because a request wanted it back
    restored: bool = False  # its evicted KV came back


@dataclass(frozen=True)
class Recorded:
    """What ``record_encoded`` did with each fact."""

    recorded: list[EncodedFact]  # stored: the fact's KV is this now
    gone: list[EncodedFact]  # the fact is gone (forgotten, or retired): remove the blobs
    superseded: list[EncodedFact]  # claimed again since (its lease ran out): the newer claim's


async def record_encoded(conn: AsyncConnection, rows: Sequence[EncodedFact]) -> Recorded:
    """Store KV metadata of encoded facts and end their leases. A fact claimed again since (its
    lease ran out) is left to the newer claim; a fact retired, forgotten, or whose row for the
    model went (its model retired) is gone."""
    if not rows:
        return Recorded([], [], [])
    # The facts' rows are locked first: a retirement either came before (the fact is retired
    # here) or waits for this commit (and then removes the blob itself); a deletion waits too.
    ids = sorted({r.id for r in rows})
    live = set((await conn.execute(
        select(facts.c.id).where(facts.c.id.in_(ids), facts.c.deleted_at.is_(None))
        .order_by(facts.c.id).with_for_update(key_share=True))).scalars())
    await conn.execute(
        update(fact_kv).where(fact_kv.c.fact_id == bindparam("fid"),
                              fact_kv.c.model_fingerprint == bindparam("model"),
                              fact_kv.c.encode_claims == bindparam("claim")).values(
            token_ids=bindparam("token_ids"), token_count=func.cardinality(bindparam("token_ids")),
            window=bindparam("window"), context_facts=bindparam("context_facts"),
            backfill_due=False, enrolled=False,
            kv_location=bindparam("location"), kv_bytes=bindparam("nbytes"),
            kv_checksum=bindparam("checksum"),
            kv_lead_checksum=bindparam("lead_checksum"),
            encoded_at=func.clock_timestamp(), kv_evicted_at=None, kv_wanted_at=None,
            encode_error=None, retry_at=None, claimed_until=None,
            encode_attempts=fact_kv.c.encode_attempts + 1,
        ),
        [{**asdict(r), "fid": r.id, "model": r.fingerprint} for r in rows],
    )
    claims = {(fact_id, model): claim for fact_id, model, claim in (await conn.execute(
        select(fact_kv.c.fact_id, fact_kv.c.model_fingerprint, fact_kv.c.encode_claims).where(
            fact_kv.c.fact_id.in_(ids)))).all()}
    held = {r.id: claims.get((r.id, r.fingerprint)) if r.id in live else None for r in rows}
    return Recorded(
        recorded=[r for r in rows if held[r.id] == r.claim],
        gone=[r for r in rows if held[r.id] is None],
        superseded=[r for r in rows if held[r.id] not in (None, r.claim)])


_DROP_OTHER_MODELS = text("""
    DELETE FROM fact_kv o USING (
        SELECT d.fact_id, d.model_fingerprint FROM fact_kv d
        JOIN fact_kv m ON m.fact_id = d.fact_id AND m.model_fingerprint = :fingerprint
                      AND m.kv_location IS NOT NULL
        WHERE d.model_fingerprint <> :fingerprint
          AND (d.claimed_until IS NULL OR d.claimed_until <= now())
        LIMIT :limit FOR UPDATE OF d SKIP LOCKED) gone
    WHERE o.fact_id = gone.fact_id AND o.model_fingerprint = gone.model_fingerprint
    RETURNING o.kv_location
""")

async def drop_other_models(conn: AsyncConnection, fingerprint: str, limit: int
                            ) -> list[str | None]:
    """Remove up to ``limit`` rows of other models than ``fingerprint`` of facts that have its
    KV (a fleet that moved to it), leaving rows an encode holds; returns the KV locations they
    held (None: none), the blobs to delete once committed."""
    return list((await conn.execute(_DROP_OTHER_MODELS, {
        "fingerprint": fingerprint, "limit": limit})).scalars())


async def record_encode_failure(conn: AsyncConnection, fingerprint: str, fact: PendingFact,
                                error: str, base_s: float, max_s: float) -> None:
    """Count a failed encode attempt of a claim still held, keep its reason and schedule the
    retry after an exponential backoff (``base_s * 2**attempts``, at most ``max_s``)."""
    backoff = func.least(base_s * func.power(2, fact_kv.c.encode_attempts), max_s)
    await conn.execute(update(fact_kv).where(
        fact_kv.c.fact_id == fact.id, fact_kv.c.model_fingerprint == fingerprint,
        fact_kv.c.encode_claims == fact.claim).values(
        encode_attempts=fact_kv.c.encode_attempts + 1, encode_error=error[:2000],
        claimed_until=None, retry_at=func.now() + func.make_interval(0, 0, 0, 0, 0, 0, backoff)))

async def count_pending_facts(conn: AsyncConnection, fingerprint: str, max_attempts: int,
                              max_crashes: int, user_id: str | None = None) -> int:
    """Facts (of every user, or of ``user_id``) still waiting for the KV of model
    ``fingerprint`` (and still to be tried, now or after a backoff or a lease); quarantined
    facts are not, nor evicted facts no request wants."""
    k = fact_kv.c
    mine = facts.c.user_id == user_id if user_id is not None else true()
    query = select(func.count()).where(mine, *_live(fingerprint), k.kv_location.is_(None),
        k.kv_evicted_at.is_(None) | k.kv_wanted_at.is_not(None),
        k.encode_claims - k.encode_attempts < max_crashes,
        k.encode_error.is_(None) | k.encode_error.not_like(f"{QUARANTINED}:%"),
        (k.encode_attempts < max_attempts) | k.encode_error.like(f"{STORAGE_FAILURE}:%"))
    return (await conn.execute(query)).scalar_one()

async def count_backfill_facts(conn: AsyncConnection, fingerprint: str, max_crashes: int,
                               user_id: str | None = None) -> int:
    """Facts (of every user, or of ``user_id``) marked for re-encoding for model
    ``fingerprint`` and still to be tried."""
    k = fact_kv.c
    mine = facts.c.user_id == user_id if user_id is not None else true()
    query = select(func.count()).where(mine, *_live(fingerprint), k.backfill_due,
        k.kv_location.is_not(None), k.encode_claims - k.encode_attempts < max_crashes,
        k.encode_error.is_(None) | k.encode_error.like(f"{STORAGE_FAILURE}:%"))
    return (await conn.execute(query)).scalar_one()
