"""The change outbox (migration 0019): rows written by triggers on ``facts`` in the changing
transaction, taken in order by one relay at a time and deleted once published. All SQL is
parameterized."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import BigInteger, and_, bindparam, delete, func, literal, null, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from inferscale.contracts.change_events import MemoryChange
from inferscale.db.tables import facts, memory_changes

# One relay at a time (a transaction-scoped advisory lock), so changes leave in their order.
_RELAY_LOCK = 0x696E666368616E  # "infchan"


async def take_changes(conn: AsyncConnection, limit: int, with_text: bool = False
                       ) -> list[MemoryChange]:
    """The oldest ``limit`` unpublished changes, if no other relay holds the outbox (else
    none); hold the transaction until they are published and dropped. ``with_text``: an
    ``added`` change carries its fact's text, where the fact is still there."""
    if not (await conn.execute(select(func.pg_try_advisory_xact_lock(_RELAY_LOCK)))).scalar():
        return []
    c = memory_changes.c
    text = (facts.c.text if with_text else null()).label("text")
    rows = await conn.execute(
        select(memory_changes, text).select_from(memory_changes.outerjoin(facts, and_(
            literal(with_text), c.kind == "added", facts.c.id == c.fact_id,
            facts.c.user_id == c.user_id)))
        .order_by(c.id).limit(limit))
    return [MemoryChange(change_id=r.id, user_id=r.user_id, kind=r.kind, fact_id=r.fact_id,
                         superseded_by=r.superseded_by, agent_id=r.agent_id, run_id=r.run_id,
                         at=r.at, text=r.text) for r in rows]


async def drop_changes(conn: AsyncConnection, change_ids: Sequence[int]) -> None:
    """Forget changes once published."""
    await conn.execute(delete(memory_changes).where(memory_changes.c.id == func.any(
        bindparam("ids", list(change_ids), type_=ARRAY(BigInteger)))))


async def pending_changes(conn: AsyncConnection) -> int:
    """Changes not published yet."""
    return int((await conn.execute(select(func.count()).select_from(memory_changes))
                ).scalar_one())
