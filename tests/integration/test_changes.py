"""Change events on the real Postgres and broker: every change to an owner's live facts (added,
superseded by an edit, deleted, expired, forgotten) reaches the change topic once per change in
the order it was recorded, none for what changes nothing live (an import's retired versions), and
a relay that dies between publishing and dropping publishes again the same change ids (at least
once; a consumer keeping the last id per owner sees each change once)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from helpers import read_topic
from inferscale.contracts.change_events import MemoryChange
from inferscale.contracts.memory_export import ExportedFact, ExportHeader
from inferscale.core import failpoints
from inferscale.db.change_outbox import pending_changes
from inferscale.db.deletion import delete_user
from inferscale.db.expiry import retire_expired
from inferscale.db.memory_edits import add_fact, delete_fact, edit_fact
from inferscale.db.memory_io import import_facts
from inferscale.workers.change_relay import ChangeRelay

MODEL = "e" * 64


def _vector(seed: int) -> list[float]:
    return [float((seed * 17 + i) % 5) / 5 + 0.01 for i in range(384)]


@pytest.fixture
async def settings(settings, engine):
    """A topic of the test's own, and an outbox emptied of what earlier tests recorded."""
    await ChangeRelay(settings.model_copy(update={"changes_topic": "changes-earlier"}), engine,
                      settings.kafka_bootstrap).run(drain=True)
    return settings.model_copy(update={"changes_topic": f"changes-{uuid.uuid4().hex[:8]}"})


async def _mine(settings, user: str, expected: int) -> list[MemoryChange]:
    records = await read_topic(settings.kafka_bootstrap, settings.changes_topic, expected,
                               timeout_s=30)
    changes = [MemoryChange.model_validate_json(r.value) for r in records]
    assert len(changes) == expected and {c.user_id for c in changes} == {user}, changes
    return changes  # one owner, one partition: in the order published


async def test_every_change_reaches_the_topic_once_in_order(settings, engine):
    user = f"changes-{uuid.uuid4().hex[:6]}"
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        bees = await add_fact(conn, user, MODEL, "c1", "Ada keeps bees.", now, _vector(1))
        ghent = await add_fact(conn, user, MODEL, "c1", "Ada lives in Ghent.", now, _vector(2),
                               expires_at=now - timedelta(seconds=1))
        tea = await add_fact(conn, user, MODEL, "c1", "Ada drinks tea.", now, _vector(3))
    async with engine.begin() as conn:
        new_bees, _ = await edit_fact(conn, user, MODEL, bees.id, "Ada keeps bees and goats.",
                                      _vector(4))
        await delete_fact(conn, user, tea.id)
        await retire_expired(conn, 1000)
        retired = ExportedFact(id=1, text="old", conversation_id="c0", extractor="turn",
                               ts=now, created_at=now, deleted_at=now)
        await import_facts(conn, user, ExportHeader(user_id="x", origin="0" * 32,
                                                    exported_at=now), [retired], [_vector(5)])
    async with engine.begin() as conn:
        await delete_user(conn, user)

    relay = ChangeRelay(settings, engine, settings.kafka_bootstrap)
    await relay.run(drain=True)
    changes = await _mine(settings, user, 8)
    assert [(c.kind, c.fact_id, c.superseded_by) for c in changes] == [
        ("added", bees.id, None), ("added", ghent.id, None), ("added", tea.id, None),
        ("added", new_bees.id, None), ("superseded", bees.id, new_bees.id),
        ("deleted", tea.id, None), ("expired", ghent.id, None), ("forgotten", None, None)]
    ids = [c.change_id for c in changes]
    assert ids == sorted(set(ids))  # once each, in the order recorded
    assert relay.published >= len(changes)
    assert await ChangeRelay(settings, engine, settings.kafka_bootstrap).run(drain=True) == 0
    assert all(c.text is None for c in changes)  # ids only by default


async def test_added_events_carry_the_text_where_configured_and_never_a_forgotten_owners(
        settings, engine):
    settings = settings.model_copy(update={"changes_with_text": True})
    user, gone = (f"changes-{uuid.uuid4().hex[:6]}" for _ in range(2))
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        bees = await add_fact(conn, user, MODEL, "c1", "Ada keeps bees.", now, _vector(1))
        await delete_fact(conn, user, bees.id)
        await add_fact(conn, gone, MODEL, "c1", "Gus keeps goats.", now, _vector(2))
    async with engine.begin() as conn:
        await delete_user(conn, gone)  # forgotten before the relay publishes
    await ChangeRelay(settings, engine, settings.kafka_bootstrap).run(drain=True)
    records = await read_topic(settings.kafka_bootstrap, settings.changes_topic, 4, timeout_s=30)
    changes = [MemoryChange.model_validate_json(r.value) for r in records]
    assert sorted((c.user_id == user, c.kind, c.text) for c in changes) == [
        (False, "added", None), (False, "forgotten", None),
        (True, "added", "Ada keeps bees."), (True, "deleted", None)]


async def test_a_relay_dying_before_the_drop_publishes_the_same_changes_again(settings,
                                                                              engine):
    user = f"changes-{uuid.uuid4().hex[:6]}"
    async with engine.begin() as conn:
        await add_fact(conn, user, MODEL, "c1", "Ada keeps bees.", datetime.now(UTC),
                       _vector(1))
    relay = ChangeRelay(settings, engine, settings.kafka_bootstrap)
    failpoints.arm("changes.before_drop=error:EIO")
    try:
        with pytest.raises(OSError):
            await relay.handle_batch()  # published, then "crashed": the rows stay
    finally:
        failpoints.arm("")
    await relay.run(drain=True)
    changes = await _mine(settings, user, 2)
    assert [c.kind for c in changes] == ["added", "added"]
    assert changes[0].change_id == changes[1].change_id  # the same change, twice
    seen: dict[str, int] = {}
    applied = []
    for change in changes:  # what a consumer keeping the last id per owner applies
        if change.change_id > seen.get(change.user_id, 0):
            seen[change.user_id] = change.change_id
            applied.append(change)
    assert len(applied) == 1


async def test_a_relay_without_a_broker_keeps_the_changes_and_carries_on(settings, engine):
    user = f"changes-{uuid.uuid4().hex[:6]}"
    async with engine.begin() as conn:
        await add_fact(conn, user, MODEL, "c1", "Ada keeps bees.", datetime.now(UTC),
                       _vector(1))
        before = await pending_changes(conn)
    unreachable = ChangeRelay(settings, engine, "127.0.0.1:9")  # nothing listens there
    assert await unreachable.handle_batch() == 0 and unreachable.published == 0
    async with engine.connect() as conn:
        assert await pending_changes(conn) == before >= 1
    assert await ChangeRelay(settings, engine, settings.kafka_bootstrap).run(drain=True) >= 1
    assert [c.kind for c in await _mine(settings, user, 1)] == ["added"]
