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
    async with engine.begin() as conn:
        return await top_k_facts(conn, user_id, vector.tolist(), k)
