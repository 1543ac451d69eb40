"""Ingest worker on the real broker and the real Postgres."""

import asyncio
import json
import uuid

import pytest
from sqlalchemy import func, select

from helpers import extract_all, read_topic, sample_turns
from inferscale.core.settings import Settings
from inferscale.db.tables import facts
from inferscale.db.turns import count_user_rows
from inferscale.pipeline.kafka import ensure_topics, kafka_security, make_producer, publish_turns
from inferscale.workers.ingest import IngestWorker


def worker(settings, engine, **kwargs) -> IngestWorker:
    return IngestWorker(settings, settings.kafka_bootstrap, engine, **kwargs)


async def publish(settings, turns) -> int:
    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic],
                        security=kafka_security(settings))
    return await publish_turns(settings.kafka_bootstrap, settings.turns_topic, turns,
                               progress=False, security=kafka_security(settings))


async def test_locomo_conversation_stored_once_with_embeddings(settings, engine, embedder):
    turns = sample_turns()
    user = turns[0].user_id
    assert await publish(settings, turns) == len(turns)
    stats = await worker(settings, engine).run(drain=True)
    assert stats.consumed == len(turns)
    async with engine.connect() as conn:  # ingest stores turns; the extract stage makes facts
        assert await count_user_rows(conn, user) == (len(turns), 0)
    await extract_all(settings, engine, embedder)
    async with engine.connect() as conn:
        assert await count_user_rows(conn, user) == (len(turns), len(turns))
        missing = await conn.scalar(select(func.count()).where(
            facts.c.user_id == user, facts.c.embedding.is_(None)))
        texts = (await conn.execute(select(facts.c.text).where(facts.c.user_id == user))).scalars()
        assert missing == 0
        assert "3 March 2025 Sam: No, I switched careers last year." in " ".join(texts)


async def test_redelivery_after_db_commit_creates_no_duplicates(settings, engine, embedder):
    turns = sample_turns()
    user = turns[0].user_id
    await publish(settings, turns)

    async def crash_before_offset_commit(offsets):
        raise RuntimeError("killed between DB commit and offset commit")

    with pytest.raises(RuntimeError, match="killed between"):
        await worker(settings, engine,
                     after_store=crash_before_offset_commit).run(drain=True)
    async with engine.connect() as conn:
        stored_before = await count_user_rows(conn, user)
    assert stored_before[0] > 0
    # Same group: nothing was committed, so the batch is delivered again.
    stats = await worker(settings, engine).run(drain=True)
    assert stats.consumed == len(turns)
    # A full replay from another group re-reads everything.
    replay = settings.model_copy(update={"consumer_group": settings.consumer_group + "-replay"})
    replay_stats = await worker(replay, engine).run(drain=True)
    assert replay_stats.consumed == len(turns)
    assert replay_stats.turns_stored == 0
    await extract_all(settings, engine, embedder)
    async with engine.connect() as conn:
        assert await count_user_rows(conn, user) == (len(turns), len(turns))


async def test_two_workers_share_the_group(settings, engine, embedder):
    users = [f"pair-{uuid.uuid4().hex[:6]}-{i}" for i in range(16)]  # keys on every partition
    turns = [t for user in users for t in sample_turns(user)]
    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic], partitions=4,
                        security=kafka_security(settings))
    await publish(settings, turns)
    small = settings.model_copy(update={"ingest_batch_size": 16, "drain_idle_s": 3.0})
    pair: list[IngestWorker] = []

    def wait_for_the_other(me: int):
        async def after_store(_offsets) -> None:
            """Whoever is assigned first stores one batch and then waits (at most 60 s, its
            offsets uncommitted) until the rebalance gave the other worker partitions of its own:
            otherwise a fast first member may drain the topic before the second one joins."""
            for _ in range(600):
                if pair[1 - me].stats.consumed:
                    return
                await asyncio.sleep(0.1)
        return after_store

    pair += [worker(small, engine, after_store=wait_for_the_other(i)) for i in range(2)]
    a, b = pair
    await asyncio.gather(a.run(drain=True), b.run(drain=True))
    assert a.stats.turns_stored + b.stats.turns_stored == len(turns)  # each turn stored once
    assert a.stats.consumed > 0 and b.stats.consumed > 0
    await extract_all(settings, engine, embedder)
    async with engine.connect() as conn:
        for user in users:
            assert await count_user_rows(conn, user) == (len(turns) // 16, len(turns) // 16)


async def test_bad_messages_go_to_dead_letter_and_good_ones_are_kept(settings, engine, embedder):
    good = sample_turns()[:4]
    user = good[0].user_id
    base = json.loads(good[0].to_bytes())
    bad = [
        (b"{oops", "invalid json"),
        (json.dumps({**base, "version": 9, "turn_id": "v9"}).encode(), "unknown version: 9"),
        (json.dumps({k: v for k, v in base.items() if k != "speaker"}).encode(), "speaker"),
        (json.dumps({**base, "turn_id": "big", "text": "x" * 20000}).encode(), "text too large"),
    ]
    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic],
                        security=kafka_security(settings))
    producer = make_producer(settings.kafka_bootstrap, kafka_security(settings))
    await producer.start()
    try:
        for turn, (raw, _) in zip(good, bad, strict=True):
            await producer.send_and_wait(settings.turns_topic, raw, key=user.encode())
            await producer.send_and_wait(settings.turns_topic, turn.to_bytes(), key=user.encode())
    finally:
        await producer.stop()
    stats = await worker(settings, engine).run(drain=True)
    assert stats.dead_lettered == len(bad)
    await extract_all(settings, engine, embedder)
    async with engine.connect() as conn:
        assert await count_user_rows(conn, user) == (len(good), len(good))
    dead = await read_topic(settings.kafka_bootstrap, settings.dead_letter_topic, len(bad),
                            security=kafka_security(settings))
    assert len(dead) == len(bad)
    reasons = [dict(r.headers)["reason"].decode() for r in dead]
    for (raw, expected), record, reason in zip(bad, dead, reasons, strict=True):
        assert expected in reason
        assert record.value == raw
        assert dict(record.headers)["source-topic"].decode() == settings.turns_topic


async def test_a_member_without_partitions_reports_a_group_that_consumes_nothing(settings,
                                                                                 engine):
    """One partition, two members: whoever holds it gets stuck in a batch (offsets uncommitted);
    the other, without partitions, reports the group stalled (error, gauge, not ready) while
    records wait, and clears once the group commits again; with nothing waiting it stays quiet."""
    from prometheus_client import REGISTRY

    def gauge() -> float | None:
        return REGISTRY.get_sample_value("inferscale_worker_group_stalled")

    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic], partitions=1,
                        security=kafka_security(settings))
    turns = sample_turns()
    await publish(settings, turns)
    cfg = settings.model_copy(update={"group_stall_s": 1.0, "ingest_batch_size": 4})
    release = asyncio.Event()

    async def hold(_offsets) -> None:
        await release.wait()

    pair = [worker(cfg, engine, after_store=hold) for _ in range(2)]
    runs = [asyncio.create_task(w.run()) for w in pair]

    async def until(condition, timeout_s: float = 60.0) -> None:
        for _ in range(int(timeout_s * 10)):
            if condition():
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out; stalled {[w.stalled for w in pair]}, consumed "
                             f"{[w.stats.consumed for w in pair]}")

    try:
        await until(lambda: any(w.stalled for w in pair))
        idle = next(w for w in pair if w.stalled)
        holder = next(w for w in pair if w is not idle)
        assert not idle.ready and holder.ready and not holder.stalled
        assert gauge() == 1
        release.set()
        await until(lambda: not idle.stalled)
        assert idle.ready and gauge() == 0
        await until(lambda: sum(w.stats.turns_stored for w in pair) == len(turns))
        await asyncio.sleep(4 * cfg.group_stall_s)  # all committed: nothing waits, no alarm
        assert not idle.stalled and gauge() == 0
    finally:
        release.set()
        for w in pair:
            w.request_stop()
        await asyncio.gather(*runs)


def test_group_stall_setting_is_validated():
    from pydantic import ValidationError

    for bad in (0, -1, "soon"):
        with pytest.raises(ValidationError, match="group_stall_s"):
            Settings(group_stall_s=bad)
