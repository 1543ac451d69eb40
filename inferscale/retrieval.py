"""Retrieval: a user's top-k live facts for a query text (never another user's)."""

from __future__ import annotations

import asyncio

from sqlalchemy.ext.asyncio import AsyncEngine

from inferscale.db.queries import RetrievedFact, top_k_facts
from inferscale.embedder import Embedder


async def retrieve(
    engine: AsyncEngine, embedder: Embedder, user_id: str, query: str, k: int
) -> list[RetrievedFact]:
    """Embed the query off the event loop, then search the owner's facts, nearest first."""
    loop = asyncio.get_running_loop()
    vector = (await loop.run_in_executor(None, embedder.encode, [query]))[0]
    return await search(engine, user_id, vector.tolist(), k)


async def search(engine: AsyncEngine, user_id: str, vector: list[float], k: int
                 ) -> list[RetrievedFact]:
    """The owner's k live facts nearest to ``vector``, nearest first."""
    async with engine.connect() as conn:  # one statement: no BEGIN / COMMIT round trips
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        return await top_k_facts(conn, user_id, vector, k)
