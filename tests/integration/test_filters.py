"""The filter language's two paths agree with brute force on the real Postgres: for any filter
(hypothesis draws them over keys, types and operators that collide on purpose), the facts SQL
lists (``db/filter_sql.py``) are those the Python path passes (``contracts/filters.matches``),
and a filtered search, ranked by the server's in-process index or by pgvector (the index hands
costly filters to it), equals filter-then-rank over every fact; a filter too costly for the
owner is refused."""

import asyncio
import random
import uuid
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert

from inferscale.contracts.filters import Subject, matches, parse_filter
from inferscale.db.engine import create_engine
from inferscale.db.memory_edits import list_facts
from inferscale.db.reads import top_k_facts
from inferscale.db.tables import facts
from inferscale.serving.guards import FrontendError
from inferscale.serving.owner_index import OwnerIndex

MODEL = "f" * 64
KEYS = ["a", "b", "tag"]
WORDS = ["", "x", "xy", "y", "Z", "é", "10"]
SCALARS = st.one_of(st.integers(-3, 3), st.sampled_from([0.5, -1.5, 2.0, 1e20]),
                    st.sampled_from(WORDS), st.booleans(), st.none())
BASE = datetime(2025, 1, 1, tzinfo=UTC)
N = 60


def _metadata(rng: random.Random) -> dict:
    metadata = {}
    for key in KEYS:
        if rng.random() < 0.7:
            metadata[key] = _value(rng)
    return metadata


def _value(rng: random.Random):
    choice = rng.randrange(6)
    scalar = [lambda: rng.randint(-3, 3), lambda: rng.choice([0.5, -1.5, 2.0, 1e20, 1.0]),
              lambda: rng.choice(WORDS), lambda: rng.random() < 0.5, lambda: None]
    if choice == 5:
        return [rng.choice(scalar)() for _ in range(rng.randrange(4))]
    return scalar[choice]()


@pytest.fixture(scope="module")
def owner(base_settings):
    """An owner with N facts of mixed scopes, metadata and times, stored once."""
    rng = random.Random(59)
    user = f"filters-{uuid.uuid4().hex[:6]}"
    vectors = np.random.default_rng(59).normal(size=(N, 384)).astype(np.float32)
    rows = [{"user_id": user, "conversation_id": "c", "turn_ids": [f"t{i}"], "ordinal": 0,
             "extractor": "test", "text": f"fact {i}", "ts": BASE,
             "embedding": vectors[i].tolist(), "agent_id": rng.choice([None, "a1", "a2"]),
             "run_id": rng.choice([None, "r1"]), "metadata": _metadata(rng),
             "created_at": BASE + timedelta(days=rng.randrange(10))} for i in range(N)]

    async def store() -> list[int]:
        engine = create_engine(base_settings.database_url)
        try:
            async with engine.begin() as conn:
                result = await conn.execute(insert(facts).returning(facts.c.id), rows)
                return [r.id for r in result]
        finally:
            await engine.dispose()

    ids = asyncio.run(store())
    subjects = {i: Subject(user, r["agent_id"], r["run_id"], r["created_at"], r["metadata"])
                for i, r in zip(ids, rows, strict=True)}
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    return user, subjects, dict(zip(ids, unit, strict=True))


def _condition(key: str):
    times = st.sampled_from([(BASE + timedelta(days=d)).isoformat() for d in (0, 3, 9)]
                            + ["2025-01-05"])
    return st.one_of(
        st.just("*"), SCALARS,
        st.dictionaries(st.sampled_from(["eq", "ne"]), SCALARS, min_size=1),
        st.dictionaries(st.sampled_from(["gt", "gte", "lt", "lte"]),
                        st.one_of(st.integers(-3, 3), st.sampled_from([0.5, 1e20]),
                                  st.sampled_from(WORDS)), min_size=1),
        st.dictionaries(st.sampled_from(["in", "nin"]), st.lists(SCALARS, max_size=3),
                        min_size=1),
        st.fixed_dictionaries({"contains": st.one_of(st.sampled_from(WORDS),
                                                     st.integers(-3, 3), st.booleans())}),
    ) if key not in ("created_at", "agent_id", "run_id") else (
        st.dictionaries(st.sampled_from(["gt", "gte", "lt", "lte", "eq", "ne"]), times,
                        min_size=1, max_size=2)
        if key == "created_at" else st.one_of(
            st.just("*"), st.sampled_from(["a1", "a2", "r1", None]),
            st.fixed_dictionaries({"in": st.lists(st.sampled_from(["a1", "r1", "zz"]),
                                                  max_size=2)}),
            st.fixed_dictionaries({"ne": st.sampled_from(["a1", "r1", None])}),
            st.fixed_dictionaries({"contains": st.sampled_from(["a", "1", ""])})))


LEAF = st.sampled_from(KEYS + ["created_at", "agent_id", "run_id", "metadata"]).flatmap(
    lambda key: (st.dictionaries(st.sampled_from(KEYS), _condition("a"), min_size=1,
                                 max_size=2).map(lambda m: {"metadata": m})
                 if key == "metadata" else _condition(key).map(lambda c: {key: c})))
FILTERS = st.recursive(LEAF, lambda inner: st.one_of(
    st.lists(inner, min_size=1, max_size=3).map(lambda fs: {"AND": fs}),
    st.lists(inner, min_size=1, max_size=3).map(lambda fs: {"OR": fs}),
    inner.map(lambda f: {"NOT": f})), max_leaves=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=FILTERS, k=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_sql_and_the_index_equal_brute_force(base_settings, owner, raw, k, seed):
    user, subjects, unit = owner
    where = parse_filter(raw)
    passed = sorted(i for i, s in subjects.items() if matches(where, s))
    query = np.random.default_rng(seed).normal(size=384).astype(np.float32)
    query /= np.linalg.norm(query)
    scores = {i: float(unit[i] @ query) for i in passed}
    ranked = sorted(passed, key=lambda i: (-scores[i], i))[:k]

    async def both() -> tuple[list[int], list[int], list[int]]:
        engine = create_engine(base_settings.database_url)
        try:
            async with engine.connect() as conn:
                listed = [r.id for r in await list_facts(conn, user, MODEL, 0, 1000, where=where)]
                by_pg = [h.id for h in await top_k_facts(conn, user, MODEL, query.tolist(), k,
                                                         where=where)]
            index = OwnerIndex(engine, MODEL, max_bytes=64 * 1024**2)
            by_index = [h.id for h in await index.search(user, query, k, where=where)]
            # every filter costly: the index hands the search to Postgres
            handed = OwnerIndex(engine, MODEL, max_bytes=64 * 1024**2, filter_inline_cost=0)
            by_pg_index = [h.id for h in await handed.search(user, query, k, where=where)]
            return listed, by_pg, by_index, by_pg_index
        finally:
            await engine.dispose()

    listed, by_pg, by_index, by_pg_index = asyncio.run(both())
    assert listed == passed, raw
    assert by_index == ranked, raw
    for got in (by_pg, by_pg_index):
        assert set(got) == set(ranked) or _tied(scores, got, ranked), raw


def test_a_filter_too_costly_for_the_owner_is_refused_wherever_it_would_run(base_settings,
                                                                              owner):
    user, _, unit = owner
    query = next(iter(unit.values()))
    where = parse_filter({"OR": [{"a": i} for i in range(8)]})  # 8 conditions x N facts

    async def search(index_bytes: int) -> int:
        engine = create_engine(base_settings.database_url)
        try:
            index = OwnerIndex(engine, MODEL, max_bytes=index_bytes,
                               filter_max_cost=8 * N - 1)
            await index.search(user, query, 5, where=where)
        except FrontendError as exc:
            return exc.status
        finally:
            await engine.dispose()
        return 200

    assert asyncio.run(search(64 * 1024**2)) == 413  # held in process
    assert asyncio.run(search(10)) == 413  # too large to hold: Postgres would rank it


def _tied(scores: dict[int, float], got: list[int], want: list[int]) -> bool:
    """pgvector ranks in float4 arithmetic: orders may differ only between equal scores."""
    return len(got) == len(want) and all(
        abs(scores[g] - scores[w]) < 1e-5 for g, w in zip(got, want, strict=True))
