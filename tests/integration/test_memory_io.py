"""An owner's memory out and in (``db/memory_io.py``) on the real Postgres: an export holds every
version with its history, metadata and scope; importing it into another owner gives the same
memory (retired versions pointing at their successors, also across requests), importing it
again adds nothing, and imported facts never take an ordinal the owner's own facts hold."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from sqlalchemy import select

from inferscale.contracts.memory_export import ExportedFact, ExportHeader
from inferscale.contracts.scope import ANY, Scope
from inferscale.db.memory_edits import add_fact, edit_fact
from inferscale.db.memory_io import export_pages, import_facts, origin
from inferscale.db.tables import facts

MODEL = "e" * 64


def _vector(seed: int) -> list[float]:
    return [float((seed * 31 + i) % 7) / 7 + 0.01 for i in range(384)]


async def _exported(engine, user, scope=ANY) -> tuple[ExportHeader, list[ExportedFact]]:
    async with engine.connect() as conn:
        header = ExportHeader(user_id=user, origin=await origin(conn),
                              exported_at=datetime.now(UTC))
        records = [ExportedFact.model_validate(row)
                   async for page in export_pages(conn, user, scope) for row in page]
    return header, records


async def _memory(engine, user) -> list[tuple]:
    """The owner's facts as (text, scope, metadata, retired, text of its successor)."""
    async with engine.connect() as conn:
        rows = (await conn.execute(select(facts).where(facts.c.user_id == user)
                                   .order_by(facts.c.id))).all()
    text_of = {r.id: r.text for r in rows}
    return [(r.text, r.agent_id, r.run_id, r.metadata, r.deleted_at is not None,
             text_of.get(r.superseded_by)) for r in rows]


async def _owner_with_history(engine) -> str:
    user = f"io-{uuid.uuid4().hex[:6]}"
    async with engine.begin() as conn:
        bees = await add_fact(conn, user, MODEL, "c1", "Ada keeps bees.", datetime.now(UTC),
                              _vector(1), Scope("planner", None), {"topic": "bees"})
        await add_fact(conn, user, MODEL, "c1", "Ada lives in Ghent.", datetime.now(UTC),
                       _vector(2), metadata={"n": 2})
    async with engine.begin() as conn:
        await edit_fact(conn, user, MODEL, bees.id, "Ada keeps bees and goats.", _vector(3),
                        None)
    return user


async def test_an_export_imported_elsewhere_is_the_same_memory_and_only_once(engine):
    user = await _owner_with_history(engine)
    header, records = await _exported(engine, user)
    assert len(records) == 3 and records[0].deleted_at and records[0].superseded_by
    assert [r.id for r in records] == sorted(r.id for r in records)
    other = f"io-{uuid.uuid4().hex[:6]}"
    async with engine.begin() as conn:
        first = await import_facts(conn, other, header, records, [_vector(9)] * 3)
    assert len(first.ids) == 3 and first.skipped == 0
    assert await _memory(engine, other) == await _memory(engine, user)
    async with engine.begin() as conn:  # again: nothing new
        again = await import_facts(conn, other, header, records + records[:1], [_vector(9)] * 4)
    assert again.ids == [] and again.skipped == 4
    assert len(await _memory(engine, other)) == 3


async def test_history_resolves_across_requests_and_ordinals_never_collide(engine):
    user = await _owner_with_history(engine)
    header, records = await _exported(engine, user)
    other = f"io-{uuid.uuid4().hex[:6]}"
    async with engine.begin() as conn:  # the owner already has a fact from the same source
        await add_fact(conn, other, MODEL, "c1", "Its own fact.", datetime.now(UTC), _vector(5))
    for record in records:  # one request each: the old version comes before its successor
        async with engine.begin() as conn:
            await import_facts(conn, other, header, [record], [_vector(9)])
    assert (await _memory(engine, other))[1:] == await _memory(engine, user)
    async with engine.connect() as conn:
        sources = (await conn.execute(select(facts.c.conversation_id, facts.c.extractor,
                                             facts.c.turn_ids, facts.c.ordinal)
                                      .where(facts.c.user_id == other))).all()
    assert len({(c, e, tuple(t), o) for c, e, t, o in sources}) == len(sources) == 4


async def test_a_scoped_export_holds_only_its_scope(engine):
    user = await _owner_with_history(engine)
    _, records = await _exported(engine, user, Scope("planner", None))
    assert records and all(r.agent_id == "planner" for r in records)
