"""Retrieval: a user's top-k live facts for a query text (never another user's)."""

from __future__ import annotations

import asyncio

from inferscale.contracts.filters import EVERYTHING, Node
from inferscale.contracts.scope import ANY, Scope
from inferscale.db.reads import RetrievedFact
from inferscale.pipeline.embedder import Embedder
from inferscale.serving.owner_index import OwnerIndex


async def retrieve(index: OwnerIndex, embedder: Embedder, user_id: str, query: str, k: int,
                   scope: Scope = ANY, where: Node = EVERYTHING, pinned: int = 0
                   ) -> list[RetrievedFact]:
    """Embed the query off the event loop, then search the owner's facts in ``scope`` passing
    the filter ``where``, nearest first; ``pinned`` > 0: their pinned facts (at most that many,
    id order) first, then k ranked among the others."""
    if k <= 0 and pinned <= 0:
        return []
    loop = asyncio.get_running_loop()
    vector = (await loop.run_in_executor(None, embedder.encode, [query]))[0]
    return await index.search(user_id, vector, k, scope, where, pinned)
