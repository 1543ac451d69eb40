"""Adds that say when they are done: an add through the memory API is recorded as an event (the
turns it published, the facts it stored), and how far it has come is read from the turns and
facts themselves, so the answer is never stale and nothing else has to report progress.

An event's stages, in order: ``queued`` (a turn is not stored yet), ``stored`` (every turn is,
one is not extracted), ``extracted`` (every turn extracted; a live fact it produced has no KV
for the asked model yet), ``encoded`` (every live fact it produced has been encoded for that
model; an add that produced no fact is encoded once extracted). The facts an event produced are
those stored directly by it and those extracted from its turns (retired ones included, marked
not live). All SQL is parameterized.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import bindparam, insert, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.types import BigInteger, String

from inferscale.db.tables import memory_events

STAGES = ("queued", "stored", "extracted", "encoded")


@dataclass(frozen=True)
class ProducedFact:
    id: int
    live: bool
    encoded: bool  # encoded for the asked model (evicted since counts: it was ready)
    encode_error: str | None  # the last failed encode's reason, while it waits for a retry
    agent_id: str | None
    run_id: str | None


@dataclass(frozen=True)
class EventProgress:
    id: str
    user_id: str
    created_at: datetime
    turns: int
    turns_stored: int
    turns_extracted: int
    facts: list[ProducedFact]

    @property
    def stage(self) -> str:
        if self.turns_stored < self.turns:
            return "queued"
        if self.turns_extracted < self.turns:
            return "stored"
        if any(f.live and not f.encoded for f in self.facts):
            return "extracted"
        return "encoded"


async def record_event(conn: AsyncConnection, user_id: str,
                       turns: Sequence[tuple[str, str]] = (), fact_ids: Sequence[int] = ()
                       ) -> str:
    """A new event of the owner for these (conversation id, turn id) pairs and facts: its id."""
    event_id = uuid.uuid4().hex
    await conn.execute(insert(memory_events).values(
        id=event_id, user_id=user_id, turns=[list(t) for t in turns], fact_ids=list(fact_ids)))
    return event_id


_TURNS = text("""
    SELECT count(t.turn_id) AS stored, count(t.extracted_at) AS extracted
    FROM unnest(CAST(:conversations AS varchar[]), CAST(:turn_ids AS varchar[])) AS e(c, id)
    LEFT JOIN turns t ON t.user_id = :user AND t.conversation_id = e.c AND t.turn_id = e.id
""").bindparams(bindparam("conversations", type_=ARRAY(String)),
                bindparam("turn_ids", type_=ARRAY(String)))

_FACTS = text("""
    SELECT f.id, f.deleted_at IS NULL AS live, k.encoded_at IS NOT NULL AS encoded,
           k.encode_error, f.agent_id, f.run_id
    FROM facts f
    LEFT JOIN fact_kv k ON k.fact_id = f.id AND k.model_fingerprint = :model
    WHERE f.user_id = :user AND (
        f.id = ANY(:fact_ids)
        OR EXISTS (SELECT 1 FROM unnest(CAST(:conversations AS varchar[]),
                                        CAST(:turn_ids AS varchar[])) AS e(c, id)
                   WHERE f.conversation_id = e.c AND e.id = ANY(f.turn_ids)))
    ORDER BY f.id
""").bindparams(bindparam("conversations", type_=ARRAY(String)),
                bindparam("turn_ids", type_=ARRAY(String)),
                bindparam("fact_ids", type_=ARRAY(BigInteger)))


async def event_owner(conn: AsyncConnection, event_id: str) -> str | None:
    """The owner of an event (None: no such event)."""
    return (await conn.execute(select(memory_events.c.user_id).where(
        memory_events.c.id == event_id))).scalar_one_or_none()


async def event_progress(conn: AsyncConnection, user_id: str, event_id: str, model: str
                         ) -> EventProgress | None:
    """How far the owner's event has come for ``model`` (None: the owner has no such event)."""
    row = (await conn.execute(select(memory_events).where(
        memory_events.c.id == event_id, memory_events.c.user_id == user_id))).one_or_none()
    if row is None:
        return None
    conversations = [str(t[0]) for t in row.turns]
    turn_ids = [str(t[1]) for t in row.turns]
    counts = (await conn.execute(_TURNS, {"user": user_id, "conversations": conversations,
                                          "turn_ids": turn_ids})).one()
    produced = (await conn.execute(_FACTS, {
        "user": user_id, "model": model, "fact_ids": list(row.fact_ids),
        "conversations": conversations, "turn_ids": turn_ids})).all()
    return EventProgress(row.id, row.user_id, row.created_at, len(turn_ids), counts.stored,
                         counts.extracted, [ProducedFact(*f) for f in produced])
