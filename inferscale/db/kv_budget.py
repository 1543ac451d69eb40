"""The KV budget in Postgres: which facts lose their KV (for one model; the budgets count every
model's) to keep the durable tier under its budgets, evicted facts a request wants encoded
again, and when each user and each fact (by each model) was last served. All SQL is
parameterized.

Invariants:
- a fact's KV for a model is evicted only while no encode holds it (its lease) and while no
  request served the fact by that model within the grace period (``fact_kv.served_at``: so no
  plan in flight names it); its text and embedding stay, and it is served as text until encoded
  again;
- the budgets hold for active users too: only KV served within the grace is spared, so after a
  round a user holds at most the larger of their budget and the KV of their facts served within
  the grace (at most k facts a request), and the tier the larger of its budget and all KV served
  within the grace (rows an encode holds aside);
- one statement picks the victims and clears their KV columns, so no server plans them after
  the commit; the caller deletes their blobs after the commit (a crash in between leaves blobs
  the orphan sweep removes: it counts evicted rows as owning none);
- one evictor at a time (a transaction-scoped advisory lock): several workers never evict the
  same excess twice;
- a request that misses KV wants back only the evicted facts it missed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

_LOCK = 0x1F5C_0B0D  # the advisory lock of the evictor

_EVICT = """
    WITH live AS (
        SELECT k.fact_id, k.model_fingerprint, f.user_id, k.kv_location, k.encoded_at,
               coalesce(k.kv_bytes, 0) AS kv_bytes, a.served_at AS user_served_at,
               coalesce(k.served_at >= now() - make_interval(secs => :grace_s), false)
                   AS in_grace
        FROM fact_kv k JOIN facts f ON f.id = k.fact_id
        LEFT JOIN memory_activity a ON a.user_id = f.user_id
        WHERE k.kv_location IS NOT NULL AND f.deleted_at IS NULL
          AND (k.claimed_until IS NULL OR k.claimed_until <= now())
    ), held AS (
        SELECT *, sum(kv_bytes) OVER ({order} ROWS UNBOUNDED PRECEDING) AS running FROM live
    ), victims AS (
        SELECT fact_id, model_fingerprint, user_id, kv_location, kv_bytes FROM held
        WHERE NOT in_grace AND {over} ORDER BY running LIMIT :batch
    )
    UPDATE fact_kv k SET kv_location = NULL, kv_checksum = NULL, kv_lead_checksum = NULL,
                         kv_bytes = NULL, backfill_due = false, kv_evicted_at = now(),
                         kv_wanted_at = NULL
    FROM victims v
    WHERE k.fact_id = v.fact_id AND k.model_fingerprint = v.model_fingerprint
      AND k.kv_location = v.kv_location
      AND (k.claimed_until IS NULL OR k.claimed_until <= now())
    RETURNING k.fact_id AS id, v.user_id, v.kv_location AS location, v.kv_bytes AS nbytes
"""
# Over the whole tier: the least recently served users' KV first (never served first), each
# user's oldest encodings first, until ``:excess`` bytes are freed; KV served within the grace
# comes last, so it never counts as freed.
_EVICT_OVER_TIER = text(_EVICT.format(
    order="ORDER BY in_grace, user_served_at NULLS FIRST, user_id, encoded_at, fact_id, "
          "model_fingerprint",
    over="running - kv_bytes < :excess"))
# Per user: each user keeps the KV served within the grace, then their most recently encoded KV
# (a fact encoded again because a request wanted it is the newest), within ``:user_budget``
# bytes, every model's counted.
_EVICT_OVER_USER = text(_EVICT.format(
    order="PARTITION BY user_id ORDER BY in_grace DESC, encoded_at DESC, fact_id DESC, "
          "model_fingerprint DESC",
    over="running > :user_budget"))


@dataclass(frozen=True)
class EvictedKV:
    """A fact's KV (for one model) that was evicted: its blob (and lead blob) are to be
    deleted."""

    id: int
    user_id: str
    location: str
    nbytes: int


async def held_kv_bytes(conn: AsyncConnection) -> int:
    """Bytes of the KV blobs live facts hold on the durable tier, for every model (as recorded
    when encoded)."""
    return int((await conn.execute(text(
        "SELECT coalesce(sum(k.kv_bytes), 0) FROM fact_kv k JOIN facts f ON f.id = k.fact_id "
        "WHERE k.kv_location IS NOT NULL AND f.deleted_at IS NULL"))).scalar_one())


async def evict_over_budget(conn: AsyncConnection, budget_bytes: int | None,
                            user_budget_bytes: int | None, grace_s: float,
                            headroom: float = 0.0, batch: int = 1000) -> list[EvictedKV]:
    """Evict, in this transaction, up to ``batch`` facts' KV blobs per budget, never KV served
    within ``grace_s``: first what each user holds beyond ``user_budget_bytes``, then, while the
    tier holds more than ``budget_bytes``, enough to bring it the fraction ``headroom`` under
    (None: no such budget). Returns the evicted facts; none when another evictor holds the
    lock."""
    if not (await conn.execute(text("SELECT pg_try_advisory_xact_lock(:key)"),
                               {"key": _LOCK})).scalar_one():
        return []
    params = {"grace_s": grace_s, "batch": batch}
    passes = []
    if user_budget_bytes is not None:
        passes.append((await conn.execute(_EVICT_OVER_USER, {
            **params, "user_budget": user_budget_bytes})).all())
    if budget_bytes is not None:
        held = await held_kv_bytes(conn)
        if held > budget_bytes:
            excess = held - int(budget_bytes * (1 - headroom))
            passes.append((await conn.execute(_EVICT_OVER_TIER, {
                **params, "excess": excess})).all())
    return [EvictedKV(r.id, r.user_id, r.location, r.nbytes) for rows in passes for r in rows]


# The user's and the facts' stamps in one statement (one round trip, atomic on its own: a
# data-modifying WITH runs once whether or not the outer statement reads it; one now()).
_STAMP = text("""
    WITH user_stamp AS (
        INSERT INTO memory_activity (user_id, served_at) VALUES (:user, now())
        ON CONFLICT (user_id) DO UPDATE SET served_at = now()
    )
    UPDATE fact_kv SET served_at = now()
    WHERE model_fingerprint = :fingerprint AND fact_id = ANY(:ids)
""")
_WANT = text("""
    UPDATE fact_kv k SET kv_wanted_at = now()
    FROM facts f
    WHERE f.id = k.fact_id AND f.user_id = :user AND f.deleted_at IS NULL
      AND k.model_fingerprint = :fingerprint AND k.fact_id = ANY(:ids)
      AND k.kv_evicted_at IS NOT NULL AND k.kv_location IS NULL AND k.kv_wanted_at IS NULL
""")


async def note_served(conn: AsyncConnection, user_id: str, fingerprint: str,
                      served: Sequence[int], missed: Sequence[int] = ()) -> int:
    """Record that model ``fingerprint`` served ``user_id``'s facts ``served`` now (the user's
    memory too: the tier evicts the least recently served users first); of them ``missed`` had
    no KV, so mark those whose KV for that model was evicted as wanted (the encode stage encodes
    them before its backlog). Returns how many were marked."""
    await conn.execute(_STAMP, {"user": user_id, "fingerprint": fingerprint,
                                "ids": list(served)})
    if not missed:
        return 0
    return int((await conn.execute(_WANT, {"user": user_id, "fingerprint": fingerprint,
                                           "ids": list(missed)})).rowcount)
