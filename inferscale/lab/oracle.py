"""Oracle-window encoding, a diagnostic of ``eval fidelity``.

A question's retrieved facts are copied to a fresh owner and encoded with exactly the prefix they
have in the served prompt (the preamble and the facts before them, in prompt order), in one
forward pass. Injecting these differs from text prefill only by numerics (the encoder's kernels
and compute dtype vs vLLM's), so the rest of the drift is context (window vs serving prefix).
"""

from __future__ import annotations

import asyncio

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from inferscale.contracts.blob_name import fact_blob
from inferscale.db.encode_queue import EncodedFact, record_encoded, register_model
from inferscale.db.tables import facts
from inferscale.kv.encoder import EncodeItem, FactEncoder
from inferscale.kv.store import KVStore

ORACLE_WINDOW = -1  # the window column of oracle-encoded copies
COPIED = ("turn_ids", "ordinal", "extractor", "text", "ts", "embedding")


async def oracle_owner(engine: AsyncEngine, encoder: FactEncoder, store: KVStore,
                       fact_ids: list[int], owner: str) -> dict[int, int]:
    """Copy ``fact_ids`` (in prompt order) to ``owner`` with oracle-window KV; returns copy id
    -> original id. Copies keep the originals' embeddings and id order, so the owner's top-k
    for the same question is the same facts in the same order."""
    async with engine.begin() as conn:
        await register_model(conn, store.fingerprint)  # so the copies get rows for its KV
        rows = {r.id: r._mapping for r in (await conn.execute(
            select(facts.c.id, *(facts.c[c] for c in COPIED)).where(
                facts.c.id.in_(fact_ids)))).all()}
        copies = {}
        for fact_id in sorted(fact_ids):
            copies[fact_id] = await conn.scalar(insert(facts).values(
                user_id=owner, conversation_id=owner,
                **{c: rows[fact_id][c] for c in COPIED}).returning(facts.c.id))
    # The token ids text mode serves these facts with.
    segments = {f: encoder.layout.fact_segment(rows[f]["text"]) for f in fact_ids}
    preamble = list(encoder.layout.preamble_ids)
    memory = preamble + [t for f in fact_ids for t in segments[f]]
    loop = asyncio.get_running_loop()
    (span,) = await loop.run_in_executor(
        None, encoder.encode, [EncodeItem(prefix_ids=[], span_ids=memory)])
    encoded, start = [], len(preamble)
    for fact_id in fact_ids:
        ids = segments[fact_id]
        end = start + len(ids)
        blob = await loop.run_in_executor(None, store.put, fact_blob(copies[fact_id]),
                                          span.k[:, start:end], span.v[:, start:end], ids,
                                          ORACLE_WINDOW)
        encoded.append(EncodedFact(
            id=copies[fact_id], claim=0, token_ids=ids, window=ORACLE_WINDOW,
            context_facts=None,  # never backfilled
            fingerprint=store.fingerprint, location=blob.location, nbytes=blob.nbytes,
            checksum=blob.checksum, lead_checksum=None))
        start = end
    async with engine.begin() as conn:
        await record_encoded(conn, encoded)
    return {copy: original for original, copy in copies.items()}
