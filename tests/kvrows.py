"""Facts with their KV for one model, for the tests: a fact's KV columns live in ``fact_kv``, one
row per fact and registered model (migration 0012)."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Select, and_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from inferscale.db.encode_queue import register_model
from inferscale.db.tables import fact_kv, facts

# The KV columns of a fact's row for a model (all but the key's fact id).
KV_COLUMNS = tuple(column for column in fact_kv.c if column.name != "fact_id")


def with_kv(fingerprint: str, *columns) -> Select:
    """SELECT ``columns`` (default: every column of ``facts`` and ``KV_COLUMNS``) FROM facts
    LEFT JOIN each fact's ``fact_kv`` row for model ``fingerprint``: one row per fact, its KV
    columns NULL where it has no row for that model; filter with ``facts.c`` and
    ``fact_kv.c``."""
    joined = facts.outerjoin(fact_kv, and_(fact_kv.c.fact_id == facts.c.id,
                                           fact_kv.c.model_fingerprint == fingerprint))
    return select(*(columns or (facts, *KV_COLUMNS))).select_from(joined)


async def set_kv(conn: AsyncConnection, fingerprint: str, fact_ids: Iterable[int],
                 **values) -> None:
    """Set these live facts' KV columns for model ``fingerprint`` (as if encoded for it),
    registering the model first where it is not (which gives every live fact a row for it)."""
    ids = sorted(set(fact_ids))
    await register_model(conn, fingerprint)
    done = await conn.execute(update(fact_kv).where(
        fact_kv.c.model_fingerprint == fingerprint, fact_kv.c.fact_id.in_(ids)).values(**values))
    assert done.rowcount == len(ids), f"facts without a row for {fingerprint[:16]}: {ids}"
