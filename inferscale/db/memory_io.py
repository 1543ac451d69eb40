"""An owner's memory out and in (``contracts/memory_export.py``). An export reads every version
of the owner's facts in id order, a page at a time, from the one snapshot its connection holds;
an import stores the records the owner does not hold yet (by ``import_key``) in one transaction,
under the owner's lock taken exclusively (extraction and edits of that owner wait), gives them
the next free ordinals of their source, and points retired versions at the versions that
replaced them once both are in. All SQL is parameterized.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, func, insert, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.types import String

from inferscale.contracts.memory_export import ExportedFact, ExportHeader, import_key
from inferscale.contracts.scope import Scope
from inferscale.db.reads import in_scope
from inferscale.db.tables import facts, memory_origin
from inferscale.db.turns import lock_users

EXPORT_PAGE = 500
_EXPORTED = [facts.c[name] for name in ExportedFact.model_fields]

_RESOLVE = text("""
    UPDATE facts o SET superseded_by = n.id, import_successor = NULL
    FROM facts n
    WHERE o.user_id = :user AND o.import_successor IS NOT NULL
      AND n.user_id = :user AND n.import_key = o.import_successor
""")


async def origin(conn: AsyncConnection) -> str:
    """This database's identity (what its exports carry)."""
    return str((await conn.execute(select(memory_origin.c.origin).limit(1))).scalar_one())


async def export_pages(conn: AsyncConnection, user_id: str, scope: Scope
                       ) -> AsyncIterator[list[dict[str, Any]]]:
    """Every version of the owner's facts in ``scope``, ids ascending, ``EXPORT_PAGE`` at a
    time, as ``ExportedFact`` fields."""
    after = 0
    while True:
        rows = (await conn.execute(select(*_EXPORTED).where(
            facts.c.user_id == user_id, facts.c.id > after, *in_scope(scope))
            .order_by(facts.c.id).limit(EXPORT_PAGE))).all()
        if not rows:
            return
        yield [dict(row._mapping) for row in rows]
        after = rows[-1].id


@dataclass(frozen=True)
class Imported:
    ids: list[int]  # the facts stored, in the records' order
    skipped: int  # records the owner held already (or given twice)


async def import_facts(conn: AsyncConnection, user_id: str, header: ExportHeader,
                       records: Sequence[ExportedFact], embeddings: Sequence[list[float]]
                       ) -> Imported:
    """Store the records the owner does not hold yet (each with its text's embedding)."""
    await lock_users(conn, [user_id], exclusive=True)
    keys = [import_key(header, r.id) for r in records]
    held = set((await conn.execute(select(facts.c.import_key).where(
        facts.c.user_id == user_id,
        facts.c.import_key == func.any(bindparam("keys", keys, type_=ARRAY(String)))))
    ).scalars())
    fresh = []
    for record, key, embedding in zip(records, keys, embeddings, strict=True):
        if key not in held:
            held.add(key)
            fresh.append((record, key, embedding))
    if not fresh:
        return Imported([], len(records))
    ordinals = {(row.conversation_id, row.extractor, tuple(row.turn_ids)): row.top + 1
                for row in await conn.execute(
        select(facts.c.conversation_id, facts.c.extractor, facts.c.turn_ids,
               func.max(facts.c.ordinal).label("top"))
        .where(facts.c.user_id == user_id, facts.c.conversation_id == func.any(bindparam(
            "conversations", sorted({r.conversation_id for r, _, _ in fresh}),
            type_=ARRAY(String))))
        .group_by(facts.c.conversation_id, facts.c.extractor, facts.c.turn_ids))}
    rows = []
    for record, key, embedding in fresh:
        source = (record.conversation_id, record.extractor, tuple(record.turn_ids))
        ordinal = ordinals.get(source, 0)
        ordinals[source] = ordinal + 1
        rows.append({
            **record.model_dump(exclude={"id", "superseded_by"}), "user_id": user_id,
            "ordinal": ordinal, "embedding": embedding, "import_key": key,
            "import_successor": None if record.superseded_by is None
            else import_key(header, record.superseded_by)})
    stored = {row.import_key: row.id for row in await conn.execute(
        insert(facts).values(rows).returning(facts.c.id, facts.c.import_key))}
    await conn.execute(_RESOLVE, {"user": user_id})
    return Imported([stored[key] for _, key, _ in fresh], len(records) - len(fresh))
