"""The KV budget on the real Postgres: eviction takes the least recently served users' KV (never
a fact served within the grace period, but the rest of an active user's KV like anyone's),
keeps text and embeddings, deletes the blobs; a request that meets an evicted fact gets that fact
encoded again before the backlog; an eviction cut short between rows and blobs loses nothing and
leaves no stale KV. Eviction and the orphan sweep are the maintenance stage's."""

import uuid
from datetime import timedelta

from kvrows import with_kv
from sqlalchemy import func, text

from helpers import ingest_and_encode, sample_turns
from inferscale.core import failpoints
from inferscale.db.encode_queue import claim_pending_facts, count_pending_facts
from inferscale.db.kv_budget import evict_over_budget, held_kv_bytes, note_served
from inferscale.db.memory_edits import list_facts
from inferscale.db.reads import live_facts, top_k_facts
from inferscale.db.tables import fact_kv, facts, memory_activity
from inferscale.kv.durable import LocalDir
from inferscale.kv.store import KVStore
from inferscale.serving.forget import forget_user
from inferscale.workers.encode import EncodeWorker
from inferscale.workers.maintenance import MaintenanceWorker

FACTS_EACH = 4
MODEL = "e" * 64  # the tests' stores' model


async def _users(settings, engine, embedder, encoder, store, *names):
    users = [f"{name}-{uuid.uuid4().hex[:6]}" for name in names]
    await ingest_and_encode(settings, engine, embedder,
                            [t for u in users for t in sample_turns(u)[:FACTS_EACH]],
                            encoder, store)
    return users


async def _rows(engine, user):
    """The user's facts with their KV for the tests' model."""
    async with engine.connect() as conn:
        return (await conn.execute(with_kv(MODEL).where(facts.c.user_id == user)
                                   .order_by(facts.c.id))).all()


async def _served(engine, user, ago_s: float) -> None:
    async with engine.begin() as conn:
        await conn.execute(memory_activity.insert().values(
            user_id=user, served_at=func.now() - timedelta(seconds=ago_s)))


async def _stamp(engine, fact_ids, ago_s: float) -> None:
    """Stamp these facts as served ``ago_s`` ago by the tests' model."""
    async with engine.begin() as conn:
        await conn.execute(fact_kv.update().where(
            fact_kv.c.model_fingerprint == MODEL, fact_kv.c.fact_id.in_(fact_ids)
        ).values(served_at=func.now() - timedelta(seconds=ago_s)))


async def _spare_others(engine, mine) -> None:
    """Stamp every fact of every other user of the shared database as served now, by every
    model: within the grace period, eviction leaves their KV alone."""
    async with engine.begin() as conn:
        await conn.execute(text("""
            UPDATE fact_kv k SET served_at = now() FROM facts f
            WHERE f.id = k.fact_id AND NOT f.user_id = ANY(:mine)"""), {"mine": list(mine)})


def _blobs(store, rows) -> list[str]:
    """The durable blobs (and lead blobs) of these facts that exist."""
    return [p.name for row in rows for p in store.durable.root.rglob(f"{row.id}*.safetensors")]


async def test_eviction_takes_the_least_recently_served_users_and_wanted_facts_return(
        settings, engine, embedder, tiny_encoder, tmp_path):
    settings = settings.model_copy(update={"window": 2, "kv_evict_grace_s": 600.0,
                                           "kv_budget_headroom": 0.0})
    store = KVStore(LocalDir(tmp_path / "kv"), MODEL, host_bytes=1 << 30)
    never, old, recent, live = await _users(settings, engine, embedder, tiny_encoder, store,
                                            "never", "old", "recent", "live")
    await _spare_others(engine, [never, old, recent, live])
    await _served(engine, old, 7200)
    await _served(engine, recent, 3600)
    await _served(engine, live, 10)
    rows = {u: await _rows(engine, u) for u in (never, old, recent, live)}
    await _stamp(engine, [r.id for r in rows[live]], 10)  # within the grace period
    assert all(r.kv_location and r.kv_bytes for rs in rows.values() for r in rs)
    each = sum(r.kv_bytes for r in rows[never])
    async with engine.connect() as conn:
        held = await held_kv_bytes(conn)
    # A budget that one user's KV and a bit more must leave: the never-served user goes, then
    # the least recently served one's oldest encodings.
    budget = held - each - each // 4
    maintained = await MaintenanceWorker(settings.model_copy(update={"kv_budget_bytes": budget}),
                                         engine, store).run(drain=True)
    after = {u: await _rows(engine, u) for u in rows}
    async with engine.connect() as conn:
        assert await held_kv_bytes(conn) <= budget
        assert await count_pending_facts(conn, MODEL, 3, 3, never) == 0  # not re-encoded unasked
    assert all(r.kv_location is None and r.kv_evicted_at for r in after[never])
    assert maintained.evicted == sum(r.kv_location is None for rs in after.values() for r in rs)
    assert any(r.kv_location is None for r in after[old])
    assert all(r.kv_location for r in after[recent] + after[live])
    assert not _blobs(store, [r for r in after[never] + after[old] if r.kv_location is None])
    assert all(r.text == before.text and r.embedding is not None
               for r, before in zip(after[never], rows[never], strict=True))

    # A request meets the never-served user's facts as text: the facts it missed are wanted,
    # and claimed before facts that were never encoded.
    backlog, = await _users(settings, engine, embedder, None, store, "backlog")
    ids = [r.id for r in after[never]]
    async with engine.begin() as conn:
        assert await note_served(conn, never, MODEL, ids) == 0  # only stamped
        assert await note_served(conn, never, MODEL, ids, ids) == FACTS_EACH  # the ones missed
        assert await note_served(conn, never, MODEL, ids, ids) == 0  # once
    async with engine.begin() as conn:
        assert await count_pending_facts(conn, MODEL, 3, 3, never) == FACTS_EACH
        claimed = await claim_pending_facts(conn, MODEL, FACTS_EACH, 2, 3, 60, 3, "neighbours")
        assert {f.user_id for f in claimed} == {never}
        await conn.rollback()
    stats = await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    assert stats.restored == FACTS_EACH and stats.encoded == 2 * FACTS_EACH  # and the backlog
    back = await _rows(engine, never)
    assert all(r.kv_location and not r.kv_evicted_at and not r.kv_wanted_at for r in back)
    for r in back:
        assert store.get(r.kv_location, r.kv_checksum).token_ids == r.token_ids
    # Forgetting a user whose KV was evicted removes what is left.
    forgotten = await forget_user(engine, store, old)
    assert forgotten.facts == FACTS_EACH and not _blobs(store, after[old])
    assert all(r.kv_location for r in await _rows(engine, backlog))


async def test_each_user_keeps_their_newest_encodings_within_their_budget(
        settings, engine, embedder, tiny_encoder, tmp_path):
    settings = settings.model_copy(update={"window": 2})
    store = KVStore(LocalDir(tmp_path / "kv"), MODEL, host_bytes=0)
    big, = await _users(settings, engine, embedder, tiny_encoder, store, "big")
    await _spare_others(engine, [big])
    rows = await _rows(engine, big)
    newest_first = sorted(rows, key=lambda r: r.encoded_at, reverse=True)
    budget = sum(r.kv_bytes for r in newest_first[:2])
    async with engine.begin() as conn:
        evicted = await evict_over_budget(conn, None, budget, 600.0)
    assert {e.id for e in evicted} == {r.id for r in newest_first[2:]}
    assert sum(e.nbytes for e in evicted) == sum(r.kv_bytes for r in newest_first[2:])
    async with engine.begin() as conn:  # within budget now: nothing more to evict
        assert await evict_over_budget(conn, None, budget, 600.0) == []


async def test_an_active_user_is_held_to_the_budgets_but_keeps_the_kv_just_served(
        settings, engine, embedder, tiny_encoder, tmp_path):
    """Served continuously, a user still loses all but the KV served within the grace (at most
    k facts a request) to their budget and to the tier's."""
    settings = settings.model_copy(update={"window": 2})
    store = KVStore(LocalDir(tmp_path / "kv"), MODEL, host_bytes=0)
    active, = await _users(settings, engine, embedder, tiny_encoder, store, "active")
    await _spare_others(engine, [active])
    rows = sorted(await _rows(engine, active), key=lambda r: r.encoded_at)
    oldest, newest = rows[0], rows[-1]
    async with engine.begin() as conn:  # a request served the user's oldest fact just now
        await note_served(conn, active, MODEL, [oldest.id])
    async with engine.begin() as conn:  # it stays, and the newest encoding within the budget
        evicted = await evict_over_budget(conn, None, oldest.kv_bytes + newest.kv_bytes, 600.0)
    assert {e.id for e in evicted} == {r.id for r in rows[1:-1]}
    async with engine.begin() as conn:  # the tier's budget: all but what was just served goes
        evicted = await evict_over_budget(conn, 0, None, 600.0)
    assert [e.id for e in evicted] == [newest.id]
    assert [r.id for r in await _rows(engine, active) if r.kv_location] == [oldest.id]
    await _stamp(engine, [oldest.id], 3600)  # past the grace, the user still the latest served
    async with engine.begin() as conn:
        assert [e.id for e in await evict_over_budget(conn, None, 0, 600.0)] == [oldest.id]


async def test_a_miss_wants_back_only_the_facts_it_missed(
        settings, engine, embedder, tiny_encoder, tmp_path):
    settings = settings.model_copy(update={"window": 2})
    store = KVStore(LocalDir(tmp_path / "kv"), MODEL, host_bytes=0)
    user, = await _users(settings, engine, embedder, tiny_encoder, store, "miss")
    await _spare_others(engine, [user])
    async with engine.begin() as conn:
        evicted = await evict_over_budget(conn, None, 0, 600.0)
    assert len(evicted) == FACTS_EACH
    store.delete([e.location for e in evicted])
    rows = await _rows(engine, user)
    served, missed = [r.id for r in rows[:2]], rows[0].id
    async with engine.begin() as conn:
        assert await note_served(conn, user, MODEL, served, [missed]) == 1
    after = await _rows(engine, user)
    assert [r.id for r in after if r.kv_wanted_at] == [missed]
    assert [r.id for r in after if r.served_at] == served
    stats = await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    assert stats.restored == 1
    assert [r.id for r in await _rows(engine, user) if r.kv_location] == [missed]


async def test_an_eviction_cut_short_before_its_blobs_loses_nothing(
        settings, engine, embedder, tiny_encoder, tmp_path):
    settings = settings.model_copy(update={"window": 2, "kv_evict_grace_s": 600.0})
    store = KVStore(LocalDir(tmp_path / "kv"), MODEL, host_bytes=0)
    user, = await _users(settings, engine, embedder, tiny_encoder, store, "cut")
    await _spare_others(engine, [user])
    rows = await _rows(engine, user)
    async with engine.begin() as conn:
        others = await held_kv_bytes(conn) - sum(r.kv_bytes for r in rows)
    budgeted = settings.model_copy(update={"kv_user_budget_bytes": 0})
    failpoints.arm("kv.evict.before_delete=error:EIO")
    try:  # the rows are evicted, the blobs stay: the stage carries on
        await MaintenanceWorker(budgeted, engine, store).run(drain=True)
    finally:
        failpoints.arm("")
    cut = await _rows(engine, user)
    assert all(r.kv_location is None and r.kv_evicted_at for r in cut)  # served as text
    leftovers = _blobs(store, rows)
    assert leftovers
    # The next stage's orphan sweep removes the leftovers; nothing else is touched.
    swept = (await MaintenanceWorker(settings, engine, store).run(drain=True)).swept
    assert swept == len(leftovers)
    assert not _blobs(store, rows)
    async with engine.connect() as conn:
        assert await held_kv_bytes(conn) >= others
    assert [r.text for r in await _rows(engine, user)] == [r.text for r in rows]


async def test_an_expired_fact_is_never_read_and_its_kv_leaves_at_the_next_round(
        settings, engine, embedder, tiny_encoder, tmp_path):
    store = KVStore(LocalDir(tmp_path / "kv"), MODEL, host_bytes=0)
    user, = await _users(settings.model_copy(update={"window": 2}), engine, embedder,
                         tiny_encoder, store, "expiring")
    rows = await _rows(engine, user)
    gone, later = rows[0], rows[1]
    async with engine.begin() as conn:
        await conn.execute(facts.update().where(facts.c.id == gone.id).values(
            expires_at=func.now() - timedelta(seconds=1)))
        await conn.execute(facts.update().where(facts.c.id == later.id).values(
            expires_at=func.now() + timedelta(hours=1)))
        held_before = await held_kv_bytes(conn)
    # Read paths leave it out at once, before any worker has run.
    async with engine.connect() as conn:
        listed = [r.id for r in await list_facts(conn, user, MODEL, 0, 100)]
        live = (await live_facts(conn, user, MODEL, [r.id for r in rows]))[1]
        ranked = [f.id for f in await top_k_facts(conn, user, MODEL,
                                                  [float(x) for x in gone.embedding], 10)]
    assert gone.id not in listed and gone.id not in live and gone.id not in ranked
    assert later.id in listed and later.id in live and later.id in ranked
    # The maintenance stage retires it and removes its blobs: its KV leaves the budget.
    maintained = await MaintenanceWorker(settings.model_copy(update={"expire_interval_s": 60}),
                                         engine, store).run(drain=True)
    assert maintained.expired >= 1
    after = {r.id: r for r in await _rows(engine, user)}
    assert after[gone.id].deleted_at is not None and after[later.id].deleted_at is None
    assert not _blobs(store, [gone]) and _blobs(store, [later])
    async with engine.connect() as conn:
        assert await held_kv_bytes(conn) <= held_before - gone.kv_bytes
