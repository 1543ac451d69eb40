"""Retrieval: the right fact first, never another user's, exact, and current with every change
to the owner's memory (the in-process index against the real Postgres)."""

import asyncio
import dataclasses
import random
import uuid
from datetime import UTC, datetime

import numpy as np
import pytest
from kvrows import set_kv
from pydantic import ValidationError
from sqlalchemy import delete, select, text, update

from inferscale.contracts.filters import Subject
from inferscale.contracts.scope import Scope
from inferscale.core.settings import Settings
from inferscale.db.extract_queue import nearest_live_facts
from inferscale.db.reads import memory_version
from inferscale.db.tables import facts
from inferscale.db.turns import NewFact, upsert_facts
from inferscale.serving.owner_index import OwnerIndex, OwnerVectors, _capacity, decode_vectors
from inferscale.serving.retrieval import retrieve

MODEL = "c" * 64  # the served model the indexes read KV for
FACTS = {
    "alice": ["Alice's cat is named Tiger.", "Alice works as a pilot for a cargo airline.",
              "Alice is allergic to shellfish.", "Alice plays the violin on weekends."],
    "bob": ["Bob's cat is named Shadow.", "Bob works as a baker in Lyon.",
            "Bob is allergic to cats.", "Bob plays chess every Monday."],
}


def _unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=-1, keepdims=True)


def _rows(user: str, vectors: np.ndarray, start: int = 0) -> list[NewFact]:
    return [NewFact(user_id=user, conversation_id="c", turn_ids=(f"t{start + i}",), ordinal=0,
                    extractor="test", text=f"{user} {start + i}", ts=datetime.now(UTC),
                    embedding=vec.tolist()) for i, vec in enumerate(vectors)]


async def _insert(engine, rows: list[NewFact]) -> None:
    async with engine.begin() as conn:
        assert await upsert_facts(conn, rows) == len(rows)


async def _version(engine, user: str) -> int:
    async with engine.connect() as conn:
        return (await memory_version(conn, user))[0]


@pytest.fixture
def index(engine):
    return OwnerIndex(engine, MODEL, max_bytes=64 * 1024**2)


async def test_right_fact_first_and_only_own_facts(engine, embedder, index):
    owners = {name: f"{name}-{uuid.uuid4().hex[:6]}" for name in FACTS}
    rows = []
    for name, texts in FACTS.items():
        rows += [NewFact(user_id=owners[name], conversation_id="c", turn_ids=(f"t{i}",),
                         ordinal=0, extractor="test", text=text, ts=datetime.now(UTC),
                         embedding=vec.tolist())
                 for i, (text, vec) in enumerate(zip(texts, embedder.encode(texts), strict=True))]
    await _insert(engine, rows)
    hits = await retrieve(index, embedder, owners["alice"], "What is the name of the cat?", 2)
    assert hits[0].text == "Alice's cat is named Tiger."
    hits = await retrieve(index, embedder, owners["bob"], "What is his job?", 4)
    assert hits[0].text == "Bob works as a baker in Lyon."
    assert {h.text for h in hits} == set(FACTS["bob"])
    rng = random.Random(0)
    questions = ["cat", "job", "allergy", "hobby", "Tiger", "Shadow", "violin", "chess"]
    for _ in range(40):
        name = rng.choice(list(FACTS))
        hits = await retrieve(index, embedder, owners[name], rng.choice(questions), 10)
        assert {h.text for h in hits} == set(FACTS[name])
    assert await retrieve(index, embedder, "nobody-" + uuid.uuid4().hex, "cat", 5) == []
    assert await retrieve(index, embedder, owners["bob"], "cat", 0) == []


async def test_other_owners_nearer_facts_never_displace_the_owners_own(engine, index):
    """Hundreds of other owners' facts sit nearer the query than the owner's own: the search
    still returns k of the owner's, the exact nearest, in order (a global ANN index walked first
    and filtered by owner after returned fewer than k without iterative scans, and missed
    nearest ones with them; migration 0007)."""
    rng = np.random.default_rng(3)
    query = _unit(rng.standard_normal(384).astype(np.float32))
    owner, others = f"owner-{uuid.uuid4().hex[:6]}", f"crowd-{uuid.uuid4().hex[:6]}"
    near = _unit(query + 0.05 * rng.standard_normal((400, 384)).astype(np.float32))
    far = _unit(rng.standard_normal((6, 384)).astype(np.float32))
    await _insert(engine, _rows(others, near) + _rows(owner, far))
    hits = await index.search(owner, query, 5)
    assert [h.text.split()[0] for h in hits] == [owner] * 5
    distances = [h.distance for h in hits]
    assert distances == sorted(distances)
    exact = np.argsort(-(far @ query), kind="stable")[:5]  # the owner's 5 of 6 nearest
    assert [h.text for h in hits] == [f"{owner} {i}" for i in exact]


async def test_ranking_equals_postgres_exact_ranking(engine, index):
    """On 1,500 random facts the index ranks like pgvector's exact cosine ORDER BY (the
    workers' query), up to float rounding between neighbours closer than 1e-5."""
    rng = np.random.default_rng(5)
    owner = f"owner-{uuid.uuid4().hex[:6]}"
    vectors = _unit(rng.standard_normal((1500, 384)).astype(np.float32))
    await _insert(engine, _rows(owner, vectors))
    queries = _unit(rng.standard_normal((10, 384)).astype(np.float32))
    async with engine.connect() as conn:
        expected = await nearest_live_facts(conn, owner, Scope(), queries.tolist(), 50)
    for query, want in zip(queries, expected, strict=True):
        hits = await index.search(owner, query, 50)
        assert len(hits) == 50
        for hit, exact in zip(hits, want, strict=True):
            if hit.id != exact.id:  # only a float tie may swap two neighbours
                assert abs(hit.distance - (1 - float(np.asarray(exact.embedding) @ query))) < 1e-5
        assert {h.id for h in hits[:45]} <= {f.id for f in want}


async def test_index_follows_every_change_to_the_owners_memory(engine, index):
    """The first facts of an owner and every new one are found by the next request; retired and
    forgotten ones never again;
    encoding a fact (kv columns) does not move the owner's memory version."""
    rng = np.random.default_rng(7)
    owner = f"owner-{uuid.uuid4().hex[:6]}"
    query = _unit(rng.standard_normal(384).astype(np.float32))
    assert await index.search(owner, query, 5) == []  # an owner without facts yet
    await _insert(engine, _rows(owner, _unit(rng.standard_normal((20, 384)).astype(np.float32))))
    before = await index.search(owner, query, 5)
    assert len(before) == 5
    version = await _version(engine, owner)
    async with engine.begin() as conn:
        ids = (await conn.execute(select(facts.c.id).where(facts.c.user_id == owner))).scalars()
        await set_kv(conn, MODEL, ids, kv_location="kv/x", kv_checksum="0" * 64,
                     token_ids=[1, 2])
    assert await _version(engine, owner) == version
    assert [h.kv_location for h in await index.search(owner, query, 5)] == ["kv/x"] * 5
    # a new fact nearest to the query leads the next answer
    await _insert(engine, _rows(owner, query[None] + 0.01, start=100))
    assert await _version(engine, owner) > version
    hits = await index.search(owner, query, 5)
    assert hits[0].text == f"{owner} 100"
    assert [h.id for h in hits[1:]] == [h.id for h in before[:4]]
    # retired (an update's delete or supersede): gone from the next answer
    version = await _version(engine, owner)
    async with engine.begin() as conn:
        await conn.execute(update(facts).where(facts.c.id == hits[0].id).values(
            deleted_at=datetime.now(UTC)))
    assert await _version(engine, owner) > version
    assert [h.id for h in await index.search(owner, query, 5)] == [h.id for h in before]
    # forgotten: rows deleted
    async with engine.begin() as conn:
        await conn.execute(delete(facts).where(facts.c.user_id == owner))
    assert await index.search(owner, query, 5) == []


async def test_facts_stored_since_are_appended_and_late_ids_are_not_missed(engine, index):
    """Facts stored since the last read are appended in place (no copy of the owner's rows); a
    fact committed late with an id below ones already read is found too (the counters show the
    append would miss it, so the ids are re-read)."""
    rng = np.random.default_rng(17)
    owner = f"owner-{uuid.uuid4().hex[:6]}"
    query = _unit(rng.standard_normal(384).astype(np.float32))
    async with engine.connect() as conn:
        late_id = await conn.scalar(text("SELECT nextval('facts_id_seq')"))
    await _insert(engine, _rows(owner, _unit(rng.standard_normal((10, 384)).astype(np.float32))))
    first = await index.current(owner)
    await _insert(engine, _rows(owner, query[None], start=50))
    second = await index.current(owner)
    assert second.buffer is first.buffer and len(second.ids) == 11
    assert (await index.search(owner, query, 1))[0].text == f"{owner} 50"
    late = _rows(owner, query[None], start=60)[0]
    async with engine.begin() as conn:
        await conn.execute(facts.insert().values(id=late_id, **{
            **dataclasses.asdict(late), "turn_ids": list(late.turn_ids)}))
    third = await index.current(owner)
    assert late_id in third.ids.tolist() and len(third.ids) == 12
    assert {h.text for h in await index.search(owner, query, 2)} == {f"{owner} 50",
                                                                     f"{owner} 60"}


async def test_an_owners_versions_grow_in_commit_order_under_concurrent_writers(engine):
    """A writer that draws its version number while another transaction holds the owner's row
    (it stored facts and goes on to retire one) must not commit a version below that one's:
    a server holding the newer version would keep a copy without the waiting writer's facts."""
    rng = np.random.default_rng(23)
    owner = f"owner-{uuid.uuid4().hex[:6]}"
    vectors = _unit(rng.standard_normal((3, 384)).astype(np.float32))
    await _insert(engine, _rows(owner, vectors[:1]))

    async def second_writer():
        async with engine.begin() as conn:
            await upsert_facts(conn, _rows(owner, vectors[2:], start=20))

    async with engine.connect() as conn:
        async with conn.begin():
            await upsert_facts(conn, _rows(owner, vectors[1:2], start=10))  # holds the row
            waiting = asyncio.create_task(second_writer())
            await asyncio.sleep(0.5)  # it draws its number and waits for the row
            await conn.execute(update(facts).where(facts.c.text == f"{owner} 0").values(
                deleted_at=datetime.now(UTC)))
            first = await memory_version(conn, owner)
        await waiting
    assert await _version(engine, owner) > first[0]


async def test_a_fact_retired_after_the_index_read_the_owner_is_never_served(engine, index):
    """The index ranks its held copy first; the hits' rows come with the memory version, so a
    fact retired since the copy was read is not served, and k live facts still come back."""
    rng = np.random.default_rng(11)
    owner = f"owner-{uuid.uuid4().hex[:6]}"
    query = _unit(rng.standard_normal(384).astype(np.float32))
    await _insert(engine, _rows(owner, _unit(rng.standard_normal((30, 384)).astype(np.float32))))
    held = await index.current(owner)
    nearest = (await index.search(owner, query, 3))[0]
    async with engine.begin() as conn:
        await conn.execute(update(facts).where(facts.c.id == nearest.id).values(
            deleted_at=datetime.now(UTC)))
    assert index._owners[owner] is held  # the stale copy, as a concurrent retirement leaves it
    hits = await index.search(owner, query, 3)
    assert len(hits) == 3 and nearest.id not in {h.id for h in hits}
    assert index._owners[owner].version > held.version


async def test_ties_break_by_id(engine, index):
    owner = f"owner-{uuid.uuid4().hex[:6]}"
    same = np.tile(_unit(np.arange(1, 385, dtype=np.float32)), (6, 1))
    await _insert(engine, _rows(owner, same))
    hits = await index.search(owner, same[0], 4)
    assert [h.id for h in hits] == sorted(h.id for h in hits)
    assert len({h.id for h in hits}) == 4


async def test_least_recently_used_owners_leave_within_the_budget(engine):
    rng = np.random.default_rng(13)
    owners = [f"owner-{uuid.uuid4().hex[:6]}" for _ in range(3)]
    for owner in owners:
        await _insert(engine, _rows(owner, _unit(rng.standard_normal((100, 384)).astype(
            np.float32))))
    per_owner = 100 * 8 + _capacity(100) * 384 * 4
    index = OwnerIndex(engine, MODEL, max_bytes=2 * per_owner + per_owner // 2)  # room for two
    query = _unit(rng.standard_normal(384).astype(np.float32))
    for owner in owners:
        assert len(await index.search(owner, query, 5)) == 5
    assert index.nbytes <= index.max_bytes
    assert [owner in index for owner in owners] == [False, True, True]
    assert len(await index.search(owners[0], query, 5)) == 5  # reloaded when asked again


async def test_an_owner_larger_than_the_budget_is_ranked_by_postgres(engine):
    """More facts than the whole budget holds: never loaded, still exact."""
    rng = np.random.default_rng(19)
    owner = f"owner-{uuid.uuid4().hex[:6]}"
    vectors = _unit(rng.standard_normal((50, 384)).astype(np.float32))
    await _insert(engine, _rows(owner, vectors))
    index = OwnerIndex(engine, MODEL, max_bytes=49 * (384 * 4 + 8))
    query = _unit(rng.standard_normal(384).astype(np.float32))
    hits = await index.search(owner, query, 5)
    assert [h.text for h in hits] == [f"{owner} {i}" for i in np.argsort(-(vectors @ query))[:5]]
    assert index.nbytes == 0 and await index.current(owner) is None


async def test_a_scoped_search_ranks_only_that_agents_or_runs_facts(engine, index):
    """Scopes (turn event v2) filter retrieval exactly: held vectors (loaded, then appended to)
    and Postgres's ranking (an owner over the budget) agree with a brute-force ranking of the
    facts in scope, and never return another agent's or run's."""
    rng = np.random.default_rng(23)
    owner = f"owner-{uuid.uuid4().hex[:6]}"
    scopes = [Scope(agent, run) for agent in ("coach", "chef", None) for run in ("r1", None)]
    vectors = _unit(rng.standard_normal((60, 384)).astype(np.float32))
    chosen = [scopes[i % len(scopes)] for i in range(60)]

    def rows(start: int, stop: int) -> list[NewFact]:
        return [dataclasses.replace(row, agent_id=chosen[start + i].agent_id,
                                    run_id=chosen[start + i].run_id)
                for i, row in enumerate(_rows(owner, vectors[start:stop], start))]

    async def check(search) -> None:
        for scope in [Scope(), Scope(agent_id="coach"), Scope(run_id="r1"),
                      Scope("chef", "r1"), Scope(agent_id="nobody")]:
            inside = [i for i, s in enumerate(chosen[:len(expected_rows)])
                      if all(getattr(s, name) == value for name, value in scope.items())]
            exact = [inside[j] for j in np.argsort(-(vectors[inside] @ query), kind="stable")[:7]]
            hits = await search(scope)
            assert [h.text for h in hits] == [f"{owner} {i}" for i in exact], scope

    query = _unit(rng.standard_normal(384).astype(np.float32))
    expected_rows = rows(0, 40)
    await _insert(engine, expected_rows)
    await check(lambda scope: index.search(owner, query, 7, scope))
    expected_rows = expected_rows + rows(40, 60)
    await _insert(engine, rows(40, 60))  # appended to the held vectors
    await check(lambda scope: index.search(owner, query, 7, scope))
    over_budget = OwnerIndex(engine, MODEL, max_bytes=10 * (384 * 4 + 8))
    await check(lambda scope: over_budget.search(owner, query, 7, scope))
    assert owner not in over_budget


def _subjects(agents: np.ndarray, runs: np.ndarray) -> np.ndarray:
    subjects = np.empty(len(agents), object)
    subjects[:] = [Subject("u", a, r, datetime(2025, 1, 1, tzinfo=UTC), {})
                   for a, r in zip(agents, runs, strict=True)]
    return subjects


def test_nearest_takes_every_tie_at_the_boundary():
    """Pure ranking: ids of equal scores come in id order, whichever side of the partition."""
    ids = np.asarray([50, 10, 40, 20, 30], np.int64)
    matrix = np.asarray([[1, 0], [0, 1], [1, 0], [1, 0], [0.6, 0.8]], np.float32)
    none = np.array([None] * 5, object)
    owner = OwnerVectors(1, 5, 0, ids, matrix, (none, none), _subjects(none, none),
                         np.full(5, np.inf), np.zeros(5, bool))
    got, distances = owner.nearest(np.asarray([1, 0], np.float32), 2)
    assert got.tolist() == [20, 40] and distances.tolist() == [0.0, 0.0]
    assert owner.nearest(np.asarray([1, 0], np.float32), 9)[0].tolist() == [20, 40, 50, 30, 10]
    assert owner.nearest(np.asarray([1, 0], np.float32), 0)[0].tolist() == []


def test_nearest_ranks_only_the_scope_asked_for():
    """Pure ranking: a scope filter keeps the rows whose fields equal every field it sets."""
    ids = np.asarray([10, 20, 30, 40], np.int64)
    matrix = np.asarray([[1, 0], [0.8, 0.6], [0.6, 0.8], [0, 1]], np.float32)
    agents = np.array(["a", "b", None, "a"], object)
    runs = np.array(["r1", "r1", "r1", None], object)
    owner = OwnerVectors(1, 4, 0, ids, matrix, (agents, runs), _subjects(agents, runs),
                         np.full(4, np.inf), np.zeros(4, bool))
    query = np.asarray([1, 0], np.float32)
    assert owner.nearest(query, 9)[0].tolist() == [10, 20, 30, 40]
    assert owner.nearest(query, 9, Scope(agent_id="a"))[0].tolist() == [10, 40]
    assert owner.nearest(query, 9, Scope(run_id="r1"))[0].tolist() == [10, 20, 30]
    assert owner.nearest(query, 9, Scope("a", "r1"))[0].tolist() == [10]
    assert owner.nearest(query, 9, Scope(agent_id="c"))[0].tolist() == []


def test_nearest_never_returns_an_expired_fact():
    """Pure ranking: a fact past its expiry is left out from that moment, in any scope."""
    ids = np.asarray([10, 20, 30], np.int64)
    matrix = np.asarray([[1, 0], [0.8, 0.6], [0, 1]], np.float32)
    agents = np.array(["a", "a", None], object)
    runs = np.array([None] * 3, object)
    owner = OwnerVectors(1, 3, 0, ids, matrix, (agents, runs), _subjects(agents, runs),
                         np.asarray([100.0, np.inf, 200.0]), np.zeros(3, bool))
    query = np.asarray([1, 0], np.float32)
    assert owner.nearest(query, 9, now=99.0)[0].tolist() == [10, 20, 30]
    assert owner.nearest(query, 9, now=100.0)[0].tolist() == [20, 30]  # expired at 100
    assert owner.nearest(query, 9, Scope(agent_id="a"), now=150.0)[0].tolist() == [20]
    assert owner.nearest(query, 9, now=250.0)[0].tolist() == [20]


def test_decode_vectors_reads_pgvector_binary_and_refuses_other_sizes():
    blob = np.asarray([3, 0], ">i2").tobytes() + np.asarray([0.5, -1.0, 2.0], ">f4").tobytes()
    assert decode_vectors([blob, blob]).tolist() == [[0.5, -1.0, 2.0]] * 2
    with pytest.raises(ValueError):
        decode_vectors([blob, blob[:-4] + b"\0" * 8])


@pytest.mark.parametrize("raw", ["0", "-1", "lots", "1e999"])
def test_index_budget_setting_refuses_nonsense(monkeypatch, raw):
    monkeypatch.setenv("INFERSCALE_RETRIEVAL_INDEX_BYTES", raw)
    with pytest.raises(ValidationError, match="retrieval_index_bytes"):
        Settings()


async def test_pinned_facts_come_first_in_id_order_and_the_k_are_ranked_among_the_others(
        engine, index):
    """With ``pinned``: the owner's pinned facts in the scope (at most that many, id order),
    then the k nearest of the others; held vectors and Postgres's ranking agree with brute
    force; without it, pinned facts rank like any other (memory search)."""
    rng = np.random.default_rng(29)
    owner = f"owner-{uuid.uuid4().hex[:6]}"
    vectors = _unit(rng.standard_normal((30, 384)).astype(np.float32))
    rows = [dataclasses.replace(row, agent_id="coach" if i % 2 else None)
            for i, row in enumerate(_rows(owner, vectors))]
    await _insert(engine, rows)
    async with engine.begin() as conn:
        ids = list((await conn.execute(select(facts.c.id).where(facts.c.user_id == owner)
                                       .order_by(facts.c.id))).scalars())
        pinned = [ids[i] for i in (3, 7, 8, 20)]  # 7 is the agent's (odd), 3 too
        await conn.execute(update(facts).where(facts.c.id.in_(pinned)).values(pinned=True))
    query = _unit(rng.standard_normal(384).astype(np.float32))

    def expected(scope: Scope, most: int) -> list[str]:
        inside = [i for i, row in enumerate(rows) if scope.agent_id in (None, row.agent_id)]
        first = [i for i in inside if ids[i] in pinned][:most]
        others = [i for i in inside if ids[i] not in pinned]
        ranked = [others[j] for j in np.argsort(-(vectors[others] @ query), kind="stable")[:5]]
        return [f"{owner} {i}" for i in first + ranked]

    over_budget = OwnerIndex(engine, MODEL, max_bytes=10 * (384 * 4 + 8))
    for search in (index.search, over_budget.search):
        for scope, most in ((Scope(), 16), (Scope(), 2), (Scope(agent_id="coach"), 16)):
            hits = await search(owner, query, 5, scope, pinned=most)
            assert [h.text for h in hits] == expected(scope, most), (scope, most)
            assert [h.pinned for h in hits] == [h.id in pinned for h in hits]
        plain = await search(owner, query, 30)
        assert [h.text for h in plain] == [
            f"{owner} {i}" for i in np.argsort(-(vectors @ query), kind="stable")]
        assert [h.id for h in await search(owner, query, 0, pinned=16)] == pinned
        assert await search(f"nobody-{uuid.uuid4().hex[:6]}", query, 5, pinned=16) == []
    async with engine.begin() as conn:  # a pinned fact retired leaves at once
        await conn.execute(update(facts).where(facts.c.id == pinned[0])
                           .values(deleted_at=datetime.now(UTC)))
    for search in (index.search, over_budget.search):
        hits = await search(owner, query, 5, pinned=16)
        assert [h.id for h in hits if h.pinned] == pinned[1:] and len(hits) == 8
