"""The extract queue in the turns table: leased claims of unextracted turns (a user at a time), the
nearest live facts the update step compares with, and the extraction's outcome (facts,
retirements, extracted_at) in one statement set. All SQL is parameterized."""

from __future__ import annotations

import json
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

from inferscale.contracts.scope import Scope
from inferscale.db.deletion import kv_locations
from inferscale.db.tables import facts, turns
from inferscale.db.turns import NewFact, lock_users


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
    context: list[str]  # "<speaker>: <text>" of the preceding turns of its scope, oldest first
    agent_id: str | None = None  # the turn's scopes
    run_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # the turn's

    @property
    def scope(self) -> Scope:
        return Scope(self.agent_id, self.run_id)

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
                  t.extract_claims, t.agent_id, t.run_id, t.metadata
    )
    SELECT t.*, COALESCE(ARRAY(
        SELECT c.speaker || ': ' || c.text FROM turns c
        WHERE c.user_id = t.user_id AND c.conversation_id = t.conversation_id
          AND c.agent_id IS NOT DISTINCT FROM t.agent_id AND c.run_id IS NOT DISTINCT FROM t.run_id
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
                        context=list(reversed(r.context)), agent_id=r.agent_id,
                        run_id=r.run_id, metadata=r.metadata) for r in rows]

@dataclass(frozen=True)
class StoredFact:
    """A live fact, as the update step compares new facts with it."""

    id: int
    text: str
    embedding: list[float]

async def nearest_live_facts(conn: AsyncConnection, user_id: str, scope: Scope,
                             embeddings: Sequence[Sequence[float]], n: int
                             ) -> list[list[StoredFact]]:
    """For each embedding, the user's ``n`` live facts of exactly ``scope`` (a field None:
    facts without it) nearest to it (exact, nearest first)."""
    if not embeddings or n <= 0:
        return [[] for _ in embeddings]
    rows = await conn.execute(text("""
        SELECT q.i, f.id, f.text, f.embedding::text AS embedding
        FROM unnest(CAST(:vectors AS text[])) WITH ORDINALITY AS q(v, i)
        CROSS JOIN LATERAL (
            SELECT id, text, embedding FROM facts
            WHERE user_id = :user AND deleted_at IS NULL
              AND agent_id IS NOT DISTINCT FROM :agent AND run_id IS NOT DISTINCT FROM :run
            ORDER BY embedding <=> CAST(q.v AS vector), id LIMIT :n) f
        ORDER BY q.i, (f.embedding <=> CAST(q.v AS vector)), f.id
    """), {"vectors": [_vector_text(e) for e in embeddings], "user": user_id, "n": n,
           "agent": scope.agent_id, "run": scope.run_id})
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
    RETURNING f.id, f.user_id
""")

async def record_extraction(conn: AsyncConnection, claimed: Sequence[ClaimedTurn],
                            new_facts: Sequence[NewFact], retired: Sequence[Retirement]
                            ) -> tuple[int, list[tuple[str, list[str]]]]:
    """Store the facts extracted from claimed turns, retire the facts they replace (history
    kept: ``deleted_at``, ``superseded_by``) and mark the turns extracted, for the turns whose
    claim is still held (a turn forgotten or re-leased meanwhile contributes nothing).
    Returns the number of facts stored and (user, KV locations of every model) per retired
    fact: the blobs to remove from every tier."""
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
    rows = (await conn.execute(_RETIRE, {
        "ids": [r.fact_id for r in applied], "users": [r.user_id for r in applied],
        "bys": [ids[r.by] if r.by is not None else None for r in applied]})).all()
    kv = await kv_locations(conn, [r.id for r in rows])  # after the retirement's row locks
    return len(ids), [(r.user_id, list(kv.get(r.id, []))) for r in rows]

async def count_unextracted_turns(conn: AsyncConnection) -> int:
    """Turns whose facts are not extracted yet."""
    query = select(func.count()).where(turns.c.extracted_at.is_(None))
    return (await conn.execute(query)).scalar_one()
