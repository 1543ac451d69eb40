"""Adds that say when they are done (``db/memory_events.py``) on the real Postgres and broker: an
add's event goes queued, stored, extracted, encoded as its turns pass the real stages, lists the
facts they produced, is another owner's to nobody, and leaves with its owner."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import text

from helpers import extract_all, ingest, sample_turns
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.db.encode_queue import register_model
from inferscale.db.memory_edits import add_fact, delete_fact
from inferscale.db.memory_events import event_progress, record_event
from inferscale.kv.durable import LocalDir
from inferscale.kv.store import KVStore
from inferscale.serving.forget import forget_user
from inferscale.workers.encode import EncodeWorker


@pytest.fixture(autouse=True)
async def one_test_one_memory(engine):
    """No registered models left behind: a worker registering one enrols every live fact."""
    yield
    async with engine.begin() as conn:
        await conn.execute(text("DELETE FROM kv_models"))


async def _progress(engine, user, event, model):
    async with engine.connect() as conn:
        return await event_progress(conn, user, event, model)


async def test_an_add_of_turns_goes_queued_stored_extracted_encoded(
        settings, engine, embedder, tiny_encoder, tiny_models, tmp_path):
    llama = model_fingerprint(tiny_models["llama"])
    turns = sample_turns()[:3]
    user = turns[0].user_id
    async with engine.begin() as conn:
        await register_model(conn, llama)
        event = await record_event(conn, user, [(t.conversation_id, t.turn_id) for t in turns])
    queued = await _progress(engine, user, event, llama)
    assert (queued.stage, queued.turns, queued.turns_stored, queued.facts) == ("queued", 3, 0, [])

    await ingest(settings, engine, turns)
    stored = await _progress(engine, user, event, llama)
    assert (stored.stage, stored.turns_stored, stored.turns_extracted) == ("stored", 3, 0)

    await extract_all(settings, engine, embedder)
    extracted = await _progress(engine, user, event, llama)
    assert extracted.stage == "extracted" and extracted.turns_extracted == 3
    async with engine.connect() as conn:
        theirs = list((await conn.execute(text(
            "SELECT id FROM facts WHERE user_id = :u ORDER BY id"), {"u": user})).scalars())
    assert [f.id for f in extracted.facts] == theirs and theirs
    assert not any(f.encoded for f in extracted.facts)

    store = KVStore(LocalDir(tmp_path / "kv"), llama, host_bytes=0)
    await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    encoded = await _progress(engine, user, event, llama)
    assert encoded.stage == "encoded" and all(f.encoded and f.live for f in encoded.facts)
    # for a model nothing encoded for, the same event is not ready
    assert (await _progress(engine, user, event, "f" * 64)).stage == "extracted"

    # another owner never sees it; a deleted fact is listed as not live and needs no KV
    assert await _progress(engine, "someone-else", event, llama) is None
    assert await _progress(engine, user, uuid.uuid4().hex, llama) is None
    async with engine.begin() as conn:
        await delete_fact(conn, user, theirs[0])
    after_delete = await _progress(engine, user, event, llama)
    assert [f.live for f in after_delete.facts] == [False] + [True] * (len(theirs) - 1)
    assert after_delete.stage == "encoded"

    await forget_user(engine, store, user)
    assert await _progress(engine, user, event, llama) is None


async def test_a_direct_fact_is_extracted_at_once_and_encoded_by_the_worker(
        settings, engine, embedder, tiny_encoder, tiny_models, tmp_path):
    llama = model_fingerprint(tiny_models["llama"])
    user = f"user-{uuid.uuid4().hex[:8]}"
    async with engine.begin() as conn:
        await register_model(conn, llama)
        record = await add_fact(conn, user, llama, "operator", "Ada keeps bees.",
                                datetime.now(UTC),
                                [float(x) for x in embedder.encode(["Ada keeps bees."])[0]])
        event = await record_event(conn, user, fact_ids=[record.id])
        nothing = await record_event(conn, user)  # an add that stored nothing is done
    direct = await _progress(engine, user, event, llama)
    assert (direct.stage, direct.turns, [f.id for f in direct.facts]) == (
        "extracted", 0, [record.id])
    assert (await _progress(engine, user, nothing, llama)).stage == "encoded"
    await EncodeWorker(settings, engine, tiny_encoder,
                       KVStore(LocalDir(tmp_path / "kv"), llama, host_bytes=0)).run(drain=True)
    assert (await _progress(engine, user, event, llama)).stage == "encoded"
