"""Hostile input through the real broker and Postgres: stored verbatim or dead-lettered, and
no record stops the worker."""

import asyncio
import json
import random
import uuid
from collections import Counter

from hypothesis import strategies as st
from prometheus_client import generate_latest
from sqlalchemy import select, tuple_

from helpers import extract_all, read_topic, turn
from hostile import record_keys, record_values, samples, tried, valid_events
from inferscale.contracts.events import InvalidEvent, TurnEvent, parse_record
from inferscale.db.tables import turns
from inferscale.db.turns import count_user_rows
from inferscale.devstack.stack import worker_process
from inferscale.pipeline.kafka import ensure_topics, kafka_security, make_producer
from inferscale.workers import ingest
from inferscale.workers.ingest import IngestWorker

NASTY_IDS = ["'; DROP TABLE turns; --", 'user"}, {"x": 1', "ünï\u200bcødé 🧠",
             "%s %(x)s {0} $1", "../../etc/passwd"]
# Owner ids with control characters are no ids (contracts/scope.py): dead-lettered, not stored.
CONTROL_IDS = ["tab\tnew\nline", "ctrl\x01\x1f", "nul\x00"]


async def test_nasty_ids_and_texts_are_stored_verbatim(settings, engine, embedder):
    events = [turn(uid, "t1", "Eve", f"hello from {uid!r} \x07 with 'quotes' and \"json\" {{}}")
              for uid in NASTY_IDS]
    events.append(turn("empty-text-user", "t1", "Eve", ""))
    security = kafka_security(settings)
    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic], security=security)
    producer = make_producer(settings.kafka_bootstrap, security)
    await producer.start()
    bad = [b"", b"null", b"[]", b'{"version": 1}', json.dumps({
        "version": 1, "user_id": ["a"], "conversation_id": 5, "turn_id": None, "speaker": {},
        "text": 3, "timestamp": "x"}).encode(), b"\xff" * 100]
    control = [(uid.encode(), json.dumps({  # keyed as a producer keys them
        "version": 1, "user_id": uid, "conversation_id": "c", "turn_id": "t1",
        "speaker": "Eve", "text": "hi", "timestamp": "2025-01-01T00:00:00Z"}).encode())
        for uid in CONTROL_IDS]
    try:
        for event in events:
            await producer.send_and_wait(settings.turns_topic, event.to_bytes(),
                                         key=event.user_id.encode())
        for raw in bad:
            await producer.send_and_wait(settings.turns_topic, raw)
        for key, raw in control:
            await producer.send_and_wait(settings.turns_topic, raw, key=key)
    finally:
        await producer.stop()
    stats = await IngestWorker(settings, settings.kafka_bootstrap, engine).run(
        drain=True)
    assert stats.dead_lettered == len(bad) + len(control)
    await extract_all(settings, engine, embedder)
    async with engine.connect() as conn:
        for event in events:
            row = (await conn.execute(select(turns.c.text).where(
                turns.c.user_id == event.user_id))).scalar_one()
            assert row == event.text
        assert await count_user_rows(conn, "empty-text-user") == (1, 0)  # no empty fact
        assert await count_user_rows(conn, NASTY_IDS[0]) == (1, 1)
    dead = await read_topic(settings.kafka_bootstrap, settings.dead_letter_topic,
                            len(bad) + len(control), security=kafka_security(settings))
    # keyless ones spread over partitions
    assert sorted(r.value for r in dead) == sorted(bad + [raw for _, raw in control])
    assert all(dict(r.headers)["reason"] for r in dead)


async def _send(settings, records: list[tuple[bytes | None, bytes]]) -> None:
    security = kafka_security(settings)
    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic], security=security)
    producer = make_producer(settings.kafka_bootstrap, security)
    await producer.start()
    try:
        await asyncio.gather(*[await producer.send(settings.turns_topic, value, key=key)
                               for key, value in records])
    finally:
        await producer.stop()


def _oversized_key_turn(prefix: str) -> TurnEvent:
    """A valid event whose natural key (3 x 256 four-byte characters, ~3 KB) is too large for
    its btree index: Postgres refuses it (program limit exceeded)."""
    rng = random.Random(prefix)

    def wide() -> str:
        return "".join(chr(rng.randint(0x10000, 0x10FFF)) for _ in range(256))

    return turn(wide(), "t-oversized", "Kim", "fine text").model_copy(update={
        "conversation_id": wide(), "turn_id": wide()})


async def test_a_value_the_database_refuses_is_dead_lettered_alone(settings, engine, embedder):
    user = f"refused-{uuid.uuid4().hex[:6]}"
    good = [turn(user, f"t{i}", "Kim", f"Fact {i}.") for i in range(4)]
    bad = _oversized_key_turn(user)
    await _send(settings, [(e.user_id.encode(), e.to_bytes()) for e in [*good[:2], bad, *good[2:]]])
    stats = await IngestWorker(settings, settings.kafka_bootstrap, engine).run(drain=True)
    assert (stats.turns_stored, stats.dead_lettered) == (len(good), 1)
    await extract_all(settings, engine, embedder)
    async with engine.connect() as conn:
        assert await count_user_rows(conn, user) == (len(good), len(good))
    dead = await read_topic(settings.kafka_bootstrap, settings.dead_letter_topic, 1,
                            security=kafka_security(settings))
    assert [r.value for r in dead] == [bad.to_bytes()]
    assert dict(dead[0].headers)["reason"] == b"rejected by database: ProgramLimitExceededError"
    again = await IngestWorker(settings, settings.kafka_bootstrap, engine).run(drain=True)
    assert again.consumed == 0  # the offsets were committed past the refused record


async def test_a_parser_failure_costs_one_record_only(settings, engine, embedder, monkeypatch):
    user = f"parser-bug-{uuid.uuid4().hex[:6]}"
    good = [turn(user, f"t{i}", "Kim", f"Fact {i}.") for i in range(3)]
    crash, odd = turn(user, "crash", "Kim", "CRASH"), turn(user, "odd", "Kim", "ODD")
    parse = ingest.parse_record

    def buggy_parse(key, value, max_text_bytes) -> TurnEvent:  # a parser bug, an odd reason
        event = parse(key, value, max_text_bytes)
        if event.text == "CRASH":
            raise RecursionError("parser bug")
        if event.text == "ODD":
            raise InvalidEvent("reason with a lone surrogate \ud800")
        return event

    monkeypatch.setattr(ingest, "parse_record", buggy_parse)
    await _send(settings, [(e.user_id.encode(), e.to_bytes()) for e in [good[0], crash, *good[1:],
                                                                          odd]])
    stats = await IngestWorker(settings, settings.kafka_bootstrap, engine).run(drain=True)
    assert (stats.turns_stored, stats.dead_lettered) == (len(good), 2)
    dead = await read_topic(settings.kafka_bootstrap, settings.dead_letter_topic, 2,
                            security=kafka_security(settings))
    assert {r.value: dict(r.headers)["reason"] for r in dead} == {
        crash.to_bytes(): b"unparseable: RecursionError",
        odd.to_bytes(): b"reason with a lone surrogate \\ud800"}
    assert b'reason="unparseable"' in generate_latest()  # /metrics still renders


def _poisoned(user: str) -> list[tuple[bytes | None, bytes]]:
    """(key, value) of records that each used to kill `inferscale worker` on every restart."""
    event = json.loads(turn(user, "p", "Eve", "poison").to_bytes())
    key = user.encode()

    def raw(**fields) -> bytes:
        return json.dumps({**event, **fields}).encode()

    return [
        (key, raw(turn_id="@").replace(b'"@"', b"7" * 5000)),  # past the int digit limit
        (key, raw(turn_id="@").replace(b'"@"', b"[" * 100_000 + b"]" * 100_000)),
        (key, raw(turn_id="s1", text="a \ud800 b")),  # lone surrogate, escaped
        (key, raw(turn_id="s2", text="@").replace(b'"@"', b'"\xed\xa0\x80"')),  # raw bytes
        (key, raw(turn_id="ts", timestamp="9999-12-31T23:59:59-01:00")),  # past 9999 in UTC
        (b"someone-else", raw(turn_id="km")),  # key does not match user_id
        (None, raw(turn_id="kl")),  # keyless
    ]


def _expected(records, max_text_bytes: int) -> tuple[list[TurnEvent], Counter]:
    """What the worker must do: the events to store, the (key, value) records to dead-letter."""
    valid, dead = [], Counter()
    for key, value in records:
        try:
            valid.append(parse_record(key, value, max_text_bytes))
        except InvalidEvent:
            dead[key, value] += 1
    return valid, dead


def _natural_keys(events: list[TurnEvent]) -> set[tuple[str, str, str]]:
    return {(e.user_id, e.conversation_id, e.turn_id) for e in events}


async def _stored(engine, events: list[TurnEvent]) -> set[tuple[str, str, str]]:
    """The natural keys of ``events`` that are stored as turns."""
    natural = tuple_(turns.c.user_id, turns.c.conversation_id, turns.c.turn_id)
    async with engine.connect() as conn:
        return {tuple(r) for r in await conn.execute(select(
            turns.c.user_id, turns.c.conversation_id, turns.c.turn_id).where(
                natural.in_(list(_natural_keys(events)))))}


async def test_worker_process_survives_poisoned_records(settings, engine, tiny_models, tmp_path):
    prefix = f"hostile-{uuid.uuid4().hex[:6]}"
    good = [turn(f"{prefix}-{u}", f"t{i}", "Kim", f"User {u} fact {i}.") for u in range(4)
            for i in range(10)]
    good += [TurnEvent.model_validate({  # any script, any valid timestamp; keys that fit the index
        **fields, "user_id": f"{prefix}-{fields['user_id'][:50]}",
        "conversation_id": fields["conversation_id"][:64], "turn_id": fields["turn_id"][:64]})
        for fields in samples(valid_events(), 30)]
    poisoned = _poisoned(f"{prefix}-0")
    refused = _oversized_key_turn(prefix)
    hostile = [*poisoned, (refused.user_id.encode(), refused.to_bytes()),
               *samples(st.tuples(record_keys, record_values), 200)]
    records = [(e.user_id.encode(), e.to_bytes()) for e in good] + hostile
    random.Random(3).shuffle(records)
    valid, dead = _expected(records, settings.max_text_bytes)
    assert not _expected(poisoned, settings.max_text_bytes)[0]
    valid.remove(refused)
    dead[refused.user_id.encode(), refused.to_bytes()] += 1
    cfg = settings.model_copy(update={"model_path": tiny_models["llama"], "kv_dir": tmp_path / "kv",
                                      "window": 1})
    await _send(cfg, records)
    with worker_process(cfg, tmp_path / "worker.log") as proc:
        dlq = await read_topic(cfg.kafka_bootstrap, cfg.dead_letter_topic, sum(dead.values()),
                               timeout_s=240, security=kafka_security(cfg))
        for _ in range(120):
            if await _stored(engine, valid) == _natural_keys(valid):
                break
            await asyncio.sleep(0.5)
        alive = proc.poll() is None
    tried("kafka worker", len(hostile))
    assert alive, (tmp_path / "worker.log").read_text(errors="replace")[-3000:]
    assert _natural_keys(good) <= await _stored(engine, valid)  # no good record lost
    assert await _stored(engine, valid) == _natural_keys(valid)
    assert Counter((r.key, r.value) for r in dlq) == dead  # every bad record, once
    reasons = {(r.key, r.value): dict(r.headers)["reason"].decode() for r in dlq}
    assert all(reasons.values()) and not [r for r in reasons.values() if "unparseable" in r]
    assert reasons[refused.user_id.encode(), refused.to_bytes()].startswith(
        "rejected by database: ")
