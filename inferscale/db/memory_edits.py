"""The memory API's reads and edits of one owner's facts. All SQL is parameterized.

An edit never changes a fact in place: it retires the fact (``deleted_at``, ``superseded_by``
the new one) and stores a new fact with the new text and embedding and no KV, so the serving
path never has to tell an edited fact's old KV from its new one: the old row is not live, the
new one is served as text until a worker encodes it. Retirement bumps the owner's memory
version (migration 0008), which every server checks per request. Edits and deletes take the
owner's lock shared, as the extraction stage does, and a redelivered turn never brings a fact
back: its turn is stored once and extracted once. Records show the KV of one model (the
serving one's); retiring a fact returns its KV of every model.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from types import EllipsisType
from typing import Any

from sqlalchemy import Select, and_, func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from inferscale.contracts.filters import EVERYTHING, Node
from inferscale.contracts.scope import ANY, Scope
from inferscale.db.deletion import kv_locations
from inferscale.db.filter_sql import filter_sql
from inferscale.db.reads import current, in_scope
from inferscale.db.tables import fact_kv, facts
from inferscale.db.turns import lock_users

EDIT_EXTRACTOR = "edit"  # the extractor an edited fact is stored under
OPERATOR_EXTRACTOR = "operator"  # ... and a fact an operator added directly


@dataclass(frozen=True)
class FactRecord:
    """One fact as the memory API shows it: text, provenance and the status of its KV for one
    model (``model_fingerprint``: None where the fact has no row for it)."""

    id: int
    user_id: str
    conversation_id: str
    text: str
    turn_ids: list[str]
    extractor: str
    ts: datetime
    created_at: datetime
    deleted_at: datetime | None
    superseded_by: int | None
    token_count: int | None
    kv_encoded: bool
    kv_location: str | None  # its durable blob (None: not encoded, or evicted)
    kv_bytes: int | None
    kv_evicted: bool
    model_fingerprint: str | None
    encoded_at: datetime | None
    agent_id: str | None
    run_id: str | None
    metadata: dict[str, Any]
    expires_at: datetime | None
    pinned: bool

    def as_json(self, memory_tiers: list[str] | None = None) -> dict[str, Any]:
        """The record as the API returns it (timestamps in ISO 8601), with the tiers that
        hold its KV: "durable", and the memory tiers of the server answering where known."""
        tiers = (["durable"] if self.kv_location else []) + (memory_tiers or [])
        return {"id": self.id, "user_id": self.user_id, "text": self.text,
                "conversation_id": self.conversation_id, "turn_ids": self.turn_ids,
                "agent_id": self.agent_id, "run_id": self.run_id, "metadata": self.metadata,
                "extractor": self.extractor, "ts": self.ts.isoformat(),
                "created_at": self.created_at.isoformat(),
                "deleted_at": self.deleted_at.isoformat() if self.deleted_at else None,
                "superseded_by": self.superseded_by,
                "expires_at": self.expires_at.isoformat() if self.expires_at else None,
                "pinned": self.pinned,
                "kv": {"encoded": self.kv_encoded, "tokens": self.token_count,
                       "bytes": self.kv_bytes, "evicted": self.kv_evicted, "tiers": tiers,
                       "model_fingerprint": self.model_fingerprint,
                       "encoded_at": self.encoded_at.isoformat() if self.encoded_at else None}}


def _records(fingerprint: str) -> Select:
    """Facts with their KV for the model ``fingerprint``, as ``FactRecord`` fields."""
    k = fact_kv.c
    return select(facts.c.id, facts.c.user_id, facts.c.conversation_id, facts.c.text,
                  facts.c.turn_ids, facts.c.extractor, facts.c.ts, facts.c.created_at,
                  facts.c.deleted_at, facts.c.superseded_by, k.token_count,
                  k.kv_location.is_not(None).label("kv_encoded"), k.kv_location, k.kv_bytes,
                  k.kv_evicted_at.is_not(None).label("kv_evicted"), k.model_fingerprint,
                  k.encoded_at, facts.c.agent_id, facts.c.run_id, facts.c.metadata,
                  facts.c.expires_at, facts.c.pinned).select_from(
        facts.outerjoin(fact_kv, and_(k.fact_id == facts.c.id,
                                      k.model_fingerprint == fingerprint)))


def _record(row: Any) -> FactRecord:
    return FactRecord(**{**row._mapping, "turn_ids": list(row.turn_ids)})


async def list_facts(conn: AsyncConnection, user_id: str, fingerprint: str, after_id: int,
                     limit: int, scope: Scope = ANY, where: Node = EVERYTHING, offset: int = 0
                     ) -> list[FactRecord]:
    """The owner's live facts in ``scope`` passing the filter ``where`` with ids above
    ``after_id``, in id order, at most ``limit`` after skipping ``offset``, with their KV for
    model ``fingerprint``."""
    rows = await conn.execute(_records(fingerprint).where(
        facts.c.user_id == user_id, current(), facts.c.id > after_id,
        *in_scope(scope), filter_sql(where)).order_by(facts.c.id).offset(offset).limit(limit))
    return [_record(row) for row in rows]


async def count_facts(conn: AsyncConnection, user_id: str, where: Node = EVERYTHING) -> int:
    """How many live facts of the owner pass the filter ``where``."""
    return int((await conn.execute(select(func.count()).select_from(facts).where(
        facts.c.user_id == user_id, current(), filter_sql(where))
    )).scalar_one())


async def get_facts(conn: AsyncConnection, user_id: str, fingerprint: str,
                    fact_ids: list[int]) -> list[FactRecord]:
    """These live facts of the owner (the others left out), in id order, with their KV for
    model ``fingerprint``."""
    rows = await conn.execute(_records(fingerprint).where(
        facts.c.user_id == user_id, current(), facts.c.id.in_(fact_ids))
        .order_by(facts.c.id))
    return [_record(row) for row in rows]


async def owners_with_facts(conn: AsyncConnection, owners: list[str] | None, limit: int,
                            agents: list[str] | None = None, runs: list[str] | None = None
                            ) -> dict[str, int]:
    """The owners (among ``owners``; None: any) with live facts of these agents and runs
    (None: any), and how many, at most ``limit`` in owner order."""
    stmt = (select(facts.c.user_id, func.count()).where(facts.c.deleted_at.is_(None))
            .group_by(facts.c.user_id).order_by(facts.c.user_id).limit(limit))
    if owners is not None:
        stmt = stmt.where(facts.c.user_id.in_(owners))
    if agents is not None:
        stmt = stmt.where(facts.c.agent_id.in_(agents))
    if runs is not None:
        stmt = stmt.where(facts.c.run_id.in_(runs))
    return {row[0]: int(row[1]) for row in await conn.execute(stmt)}


async def get_fact(conn: AsyncConnection, user_id: str, fingerprint: str, fact_id: int,
                   live_only: bool = True) -> FactRecord | None:
    """One of the owner's facts with its KV for model ``fingerprint`` (None: no such fact of
    this owner, or retired where ``live_only``)."""
    stmt = _records(fingerprint).where(facts.c.user_id == user_id, facts.c.id == fact_id)
    if live_only:
        stmt = stmt.where(facts.c.deleted_at.is_(None))
    row = (await conn.execute(stmt)).first()
    return _record(row) if row else None


_HISTORY = text("""
    WITH RECURSIVE earlier(id) AS (
        SELECT CAST(:id AS bigint)
        UNION SELECT f.id FROM facts f JOIN earlier e ON f.superseded_by = e.id
        WHERE f.user_id = :user
    ), later(id) AS (
        SELECT CAST(:id AS bigint)
        UNION SELECT f.superseded_by FROM facts f JOIN later l ON f.id = l.id
        WHERE f.user_id = :user AND f.superseded_by IS NOT NULL
    )
    SELECT id FROM earlier UNION SELECT id FROM later
""")


async def fact_history(conn: AsyncConnection, user_id: str, fingerprint: str, fact_id: int
                       ) -> list[FactRecord] | None:
    """Every version of a fact, oldest first: the facts it replaced (recursively) and the ones
    that replaced it, with their KV for model ``fingerprint``; None where the owner has no such
    fact."""
    if await get_fact(conn, user_id, fingerprint, fact_id, live_only=False) is None:
        return None
    ids = [row.id for row in await conn.execute(_HISTORY, {"id": fact_id, "user": user_id})]
    rows = await conn.execute(_records(fingerprint).where(facts.c.user_id == user_id,
                                                      facts.c.id.in_(ids)).order_by(facts.c.id))
    return [_record(row) for row in rows]


async def delete_fact(conn: AsyncConnection, user_id: str, fact_id: int
                      ) -> tuple[bool, list[str]]:
    """Retire one live fact of the owner: (whether it was live, its KV locations for every
    model: the blobs to remove from every tier)."""
    await lock_users(conn, [user_id], exclusive=False)
    row = (await conn.execute(
        facts.update().where(facts.c.id == fact_id, facts.c.user_id == user_id,
                             facts.c.deleted_at.is_(None))
        .values(deleted_at=func.clock_timestamp()).returning(facts.c.id))).first()
    return (row is not None, (await kv_locations(conn, [fact_id])).get(fact_id, []) if row else [])


async def delete_facts(conn: AsyncConnection, user_id: str, where: Node, limit: int
                       ) -> tuple[list[int], list[str]]:
    """Retire up to ``limit`` live facts of the owner passing the filter ``where`` (the lowest
    ids first): (their ids, their KV locations for every model)."""
    await lock_users(conn, [user_id], exclusive=False)
    chosen = (select(facts.c.id).where(facts.c.user_id == user_id, facts.c.deleted_at.is_(None),
                                       filter_sql(where))
              .order_by(facts.c.id).limit(limit).with_for_update())
    ids = sorted(row.id for row in await conn.execute(
        facts.update().where(facts.c.id.in_(chosen.scalar_subquery()))
        .values(deleted_at=func.clock_timestamp()).returning(facts.c.id)))
    locations = await kv_locations(conn, ids)
    return ids, [location for fact_id in ids for location in locations.get(fact_id, [])]


async def fact_owner(conn: AsyncConnection, fact_id: int) -> tuple[str, int] | None:
    """(the owner of a fact, the live version it is now: itself, or the last of the versions
    that replaced it) ; None where no such fact, or where its last version was deleted."""
    row = (await conn.execute(text("""
        WITH RECURSIVE later(id, user_id, superseded_by, deleted_at) AS (
            SELECT id, user_id, superseded_by, deleted_at FROM facts WHERE id = :id
            UNION ALL SELECT f.id, f.user_id, f.superseded_by, f.deleted_at
            FROM facts f JOIN later l ON f.id = l.superseded_by AND f.user_id = l.user_id
        )
        SELECT id, user_id FROM later WHERE deleted_at IS NULL"""), {"id": fact_id})).first()
    return (row.user_id, int(row.id)) if row else None


async def edit_fact(conn: AsyncConnection, user_id: str, fingerprint: str, fact_id: int,
                    new_text: str | None, embedding: list[float] | None,
                    new_metadata: dict[str, Any] | None = None,
                    new_expiry: datetime | None | EllipsisType = ...,
                    new_pinned: bool | None = None, pinned_max: int = 0
                    ) -> tuple[FactRecord, list[str]] | None:
    """Replace one live fact of the owner by a new fact with ``new_text`` (and its
    ``embedding``), ``new_metadata``, ``new_expiry`` and / or ``new_pinned`` (None, ``...``
    for the expiry: the old fact's; same owner, scope, conversation, source turns and time; no
    KV yet) and retire the old one, superseded by it (``PinnedLimit`` where pinning it would
    give the owner more than ``pinned_max`` pinned facts):
    (the new fact, with its KV for model ``fingerprint``; the old fact's KV locations for every
    model, to remove everywhere); None where the owner has no such live fact."""
    await lock_users(conn, [user_id], exclusive=False)
    old = (await conn.execute(select(facts).where(
        facts.c.id == fact_id, facts.c.user_id == user_id, facts.c.deleted_at.is_(None))
        .with_for_update())).first()
    if old is None:
        return None
    if new_pinned and not old.pinned:
        await _room_to_pin(conn, user_id, pinned_max)
    ordinal = (await conn.execute(select(func.coalesce(func.max(facts.c.ordinal), -1) + 1).where(
        facts.c.user_id == user_id, facts.c.conversation_id == old.conversation_id,
        facts.c.extractor == EDIT_EXTRACTOR, facts.c.turn_ids == old.turn_ids))).scalar_one()
    new_id = (await conn.execute(insert(facts).values(
        user_id=user_id, conversation_id=old.conversation_id, turn_ids=old.turn_ids,
        ordinal=ordinal, extractor=EDIT_EXTRACTOR,
        text=old.text if new_text is None else new_text, ts=old.ts,
        embedding=old.embedding if embedding is None else embedding,
        agent_id=old.agent_id, run_id=old.run_id,
        metadata=old.metadata if new_metadata is None else new_metadata,
        expires_at=old.expires_at if new_expiry is ... else new_expiry,
        pinned=old.pinned if new_pinned is None else new_pinned)
        .returning(facts.c.id))).scalar_one()
    await conn.execute(facts.update().where(facts.c.id == fact_id).values(
        deleted_at=func.clock_timestamp(), superseded_by=new_id))
    record = await get_fact(conn, user_id, fingerprint, new_id)
    assert record is not None  # inserted in this transaction
    return record, (await kv_locations(conn, [fact_id])).get(fact_id, [])


async def add_fact(conn: AsyncConnection, user_id: str, fingerprint: str, conversation_id: str,
                   fact_text: str, ts: datetime, embedding: list[float], scope: Scope = ANY,
                   metadata: dict[str, Any] | None = None, expires_at: datetime | None = None,
                   pinned: bool = False, pinned_max: int = 0) -> FactRecord:
    """Store a fact given directly (in ``scope``, with ``metadata``, expiring at
    ``expires_at``, ``pinned`` or not; no source turn, no KV yet), shown with its KV status for
    model ``fingerprint`` (``PinnedLimit`` where the owner has ``pinned_max`` pinned facts)."""
    await lock_users(conn, [user_id], exclusive=False)
    if pinned:
        await _room_to_pin(conn, user_id, pinned_max)
    ordinal = (await conn.execute(select(func.coalesce(func.max(facts.c.ordinal), -1) + 1).where(
        facts.c.user_id == user_id, facts.c.conversation_id == conversation_id,
        facts.c.extractor == OPERATOR_EXTRACTOR, facts.c.turn_ids == []))).scalar_one()
    new_id = (await conn.execute(insert(facts).values(
        user_id=user_id, conversation_id=conversation_id, turn_ids=[], ordinal=ordinal,
        extractor=OPERATOR_EXTRACTOR, text=fact_text, ts=ts, embedding=embedding,
        agent_id=scope.agent_id, run_id=scope.run_id, metadata=metadata or {},
        expires_at=expires_at, pinned=pinned).returning(facts.c.id))).scalar_one()
    record = await get_fact(conn, user_id, fingerprint, new_id)
    assert record is not None  # inserted in this transaction
    return record


class PinnedLimit(Exception):
    """Pinning one more fact would give the owner more pinned facts than allowed."""


async def _room_to_pin(conn: AsyncConnection, user_id: str, pinned_max: int) -> None:
    """Raise ``PinnedLimit`` where the owner already has ``pinned_max`` live pinned facts (a
    per-owner pinning lock, held to the end of the transaction, makes the count and the
    insert one step)."""
    await conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"),
                       {"key": f"inferscale pinned {user_id}"})
    held = (await conn.execute(select(func.count()).select_from(facts).where(
        facts.c.user_id == user_id, facts.c.pinned, current()))).scalar_one()
    if held >= pinned_max:
        raise PinnedLimit(f"{user_id!r} has {held} pinned facts, the most allowed "
                          f"(pinned_max {pinned_max})")
