"""Hostile input through the real broker and Postgres: stored verbatim or dead-lettered."""

import json

from sqlalchemy import select

from helpers import read_topic, turn
from inferscale.db.queries import count_user_rows
from inferscale.db.tables import turns
from inferscale.kafka import ensure_topics, make_producer
from workers.ingest import IngestWorker

NASTY_IDS = ["'; DROP TABLE turns; --", 'user"}, {"x": 1', "ünï\u200bcødé 🧠", "tab\tnew\nline",
             "ctrl\x01\x1f", "%s %(x)s {0} $1", "../../etc/passwd"]


async def test_nasty_ids_and_texts_are_stored_verbatim(settings, engine, embedder):
    events = [turn(uid, "t1", "Eve", f"hello from {uid!r} \x07 with 'quotes' and \"json\" {{}}")
              for uid in NASTY_IDS]
    events.append(turn("empty-text-user", "t1", "Eve", ""))
    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic])
    producer = make_producer(settings.kafka_bootstrap)
    await producer.start()
    bad = [b"", b"null", b"[]", b'{"version": 1}', json.dumps({
        "version": 1, "user_id": ["a"], "conversation_id": 5, "turn_id": None, "speaker": {},
        "text": 3, "timestamp": "x"}).encode(), b"\xff" * 100]
    try:
        for event in events:
            await producer.send_and_wait(settings.turns_topic, event.to_bytes(),
                                         key=event.user_id.encode())
        for raw in bad:
            await producer.send_and_wait(settings.turns_topic, raw)
    finally:
        await producer.stop()
    stats = await IngestWorker(settings, settings.kafka_bootstrap, engine, embedder).run(
        drain=True)
    assert stats.dead_lettered == len(bad)
    async with engine.connect() as conn:
        for event in events:
            row = (await conn.execute(select(turns.c.text).where(
                turns.c.user_id == event.user_id))).scalar_one()
            assert row == event.text
        assert await count_user_rows(conn, "empty-text-user") == (1, 0)  # no empty fact
        assert await count_user_rows(conn, NASTY_IDS[0]) == (1, 1)
    dead = await read_topic(settings.kafka_bootstrap, settings.dead_letter_topic, len(bad))
    assert sorted(r.value for r in dead) == sorted(bad)  # keyless: spread over partitions
    assert all(dict(r.headers)["reason"] for r in dead)
