"""Retrieval latency: query embedding (torch vs ONNX Runtime) and the top-k of one owner's facts
(1k or 10k facts per user, 2 or 20 owners) against the real Postgres: the server's in-process
index (``owner_index.py``) and, on the same rows, the exact pgvector query it replaced; the
index's first load and its refresh after a new fact; the server's whole path before vLLM
(retrieval, prompt composition, signed plan)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from sqlalchemy import delete, select, text, update

from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.contracts.plan import sign
from inferscale.core.settings import Settings
from inferscale.db.encode_queue import register_model
from inferscale.db.engine import create_engine
from inferscale.db.reads import top_k_facts
from inferscale.db.tables import fact_kv, facts
from inferscale.db.turns import NewFact, upsert_facts
from inferscale.lab.bench.common import percentile, print_table, write_report
from inferscale.pipeline.embedder import Embedder, load_embedder
from inferscale.serving.compose import MemoryRuntime, compose
from inferscale.serving.owner_index import OwnerIndex
from inferscale.serving.request_options import MemoryOptions

# (facts per user, owners): the measured owner and others with as many facts each.
SCENARIOS = ((1_000, 2), (10_000, 2), (1_000, 20))
WARMUP = 5
# An encoded fact's row as the server reads it: a LoCoMo-sized text, ~40 token ids, its blob's
# location and checksums (row width decides how many pages an exact scan reads).
TEXT = "2023-05-08 Caroline: I went to a LGBTQ support group yesterday and it was so powerful. "
TOKEN_IDS = list(range(1000, 1040))


def _ms(samples: list[float]) -> dict:
    ms = [s * 1e3 for s in samples]
    return {"p50_ms": statistics.median(ms), "p90_ms": percentile(ms, 90)}


def _timed(fn, inputs) -> list[float]:
    for item in inputs[:WARMUP]:
        fn(item)
    samples = []
    for item in inputs:
        began = time.perf_counter()
        fn(item)
        samples.append(time.perf_counter() - began)
    return samples


async def store_encoded_facts(engine, users: list[str], n: int, rng: np.random.Generator,
                 fingerprint: str) -> np.ndarray:
    """n random unit vectors per user as facts "fact <i> ..." (metadata ``{"n": i % 10}``)
    encoded for the model with this fingerprint; the first user's vectors."""
    stored = []
    for user in users:
        vectors = rng.standard_normal((n, 384)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        for start in range(0, n, 2000):
            rows = [NewFact(user, "bench", (f"t{i}",), 0, "bench", f"fact {i} {TEXT}",
                            datetime.now(UTC), vectors[i].tolist(), metadata={"n": i % 10})
                    for i in range(start, min(start + 2000, n))]
            async with engine.begin() as conn:
                await upsert_facts(conn, rows)
        stored.append(vectors)
    async with engine.begin() as conn:
        await register_model(conn, fingerprint)
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(update(fact_kv).where(
            fact_kv.c.model_fingerprint == fingerprint,
            fact_kv.c.fact_id.in_(select(facts.c.id).where(facts.c.user_id.in_(users)))).values(
            token_ids=TOKEN_IDS, kv_location="kv/" + "0" * 40, kv_checksum="0" * 64,
            kv_lead_checksum="0" * 64))
        for table in ("facts", "fact_kv"):  # the steady state after encoding
            await conn.execute(text(f"VACUUM ANALYZE {table}"))
    return stored[0]


def store_owner(settings: Settings, user: str, n: int) -> None:
    """``store_encoded_facts`` for one owner, encoded for the served model (prepared
    settings: a database URL and a model path)."""
    model_path = settings.model_path
    assert model_path is not None  # ``prepare`` resolves it

    async def store() -> None:
        engine = create_engine(settings.database_url)
        try:
            await store_encoded_facts(engine, [user], n, np.random.default_rng(0),
                                      model_fingerprint(model_path))
        finally:
            await engine.dispose()

    asyncio.run(store())


async def _sql_search(engine, user: str, fingerprint: str, vector: np.ndarray, k: int
                      ) -> list:
    """The server's search before the in-process index (its fallback now): pgvector ranks."""
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        return await top_k_facts(conn, user, fingerprint, vector.tolist(), k)


async def _searches(search, facts_of_owner: np.ndarray, queries: np.ndarray, k: int
                    ) -> tuple[list[float], float]:
    """Latency of ``search(query, k)`` per query (after warm-up) and its mean recall@k against
    the exact top-k of the owner's facts."""
    samples, recalls = [], []
    for i, query in enumerate(queries):
        began = time.perf_counter()
        hits = await search(query, k)
        if i >= WARMUP:
            samples.append(time.perf_counter() - began)
        exact = {int(j) for j in np.argsort(-(facts_of_owner @ query), kind="stable")[:k]}
        recalls.append(len(exact & {int(hit.text.split()[1]) for hit in hits}) / k)
    return samples, statistics.mean(recalls)


async def _server_path(rt, user: str, questions: list[str], k: int) -> dict:
    """What the server does before vLLM sees a request: retrieval (query embedding, ranking,
    the hits' rows with the memory version), prompt composition and the signed plan."""
    total, retrieval = [], []
    for i, question in enumerate(questions):
        messages = [{"role": "user", "content": question}]
        began = time.perf_counter()
        prompt = await compose(rt, user, MemoryOptions(mode="inject", k=k), messages, question)
        assert prompt.plan is not None  # "inject" always plans (the preamble at least)
        sign(prompt.plan, "bench")
        if i >= WARMUP:
            total.append(time.perf_counter() - began)
            retrieval.append(prompt.retrieval_ms / 1e3)
        assert prompt.facts_injected + prompt.facts_text == k
    return {**_ms(total), "retrieval_p50_ms": _ms(retrieval)["p50_ms"]}


async def _loads(engine, index: OwnerIndex, user: str, vector: np.ndarray, number: int
                 ) -> dict:
    """A server's first read of the owner (every embedding) and its refresh after one new fact
    ("fact <number>")."""
    began = time.perf_counter()
    await index.current(user)
    cold = time.perf_counter() - began
    async with engine.begin() as conn:
        await upsert_facts(conn, [NewFact(user, "bench", ("new",), 0, "bench",
                                          f"fact {number} {TEXT}", datetime.now(UTC),
                                          vector.tolist())])
    began = time.perf_counter()
    await index.current(user)
    return {"cold_load_ms": cold * 1e3,
            "refresh_one_new_fact_ms": (time.perf_counter() - began) * 1e3}


async def _run(settings: Settings, questions: list[str], ks: tuple[int, ...]) -> dict:
    fast, slow = load_embedder(settings), Embedder()
    embed = {"onnx": _ms(_timed(lambda q: fast.encode([q]), questions)),
             "torch": _ms(_timed(lambda q: slow.encode([q]), questions))}
    vectors = fast.encode(questions)
    rt = MemoryRuntime(settings)  # the front end's own state: tokenizer, model fingerprint, index
    engine = rt.engine
    rng, searches, loads = np.random.default_rng(0), [], []
    try:
        for n, owners in SCENARIOS:
            users = [f"bench-retrieval-{uuid.uuid4().hex[:8]}" for _ in range(owners)]
            facts_of_first = await store_encoded_facts(engine, users, n, rng, rt.fingerprint)
            index = rt.index
            new = rng.standard_normal(384).astype(np.float32)
            new /= np.linalg.norm(new)
            loads.append({"facts_per_user": n, "owners": owners,
                          **await _loads(engine, index, users[0], new, n)})
            facts_of_first = np.concatenate([facts_of_first, new[None]])
            for label, search in (
                    ("index", lambda q, k, u=users[0], i=index: i.search(u, q, k)),
                    ("sql", lambda q, k, u=users[0]: _sql_search(engine, u, rt.fingerprint, q,
                                                                   k))):
                for k in ks:
                    samples, recall = await _searches(search, facts_of_first, vectors, k)
                    searches.append({"facts_per_user": n, "owners": owners, "search": label,
                                     "k": k, **_ms(samples), "recall_at_k": recall})
            for k in ks:
                searches.append({"facts_per_user": n, "owners": owners,
                                 "search": "server: retrieval + compose + plan", "k": k,
                                 **await _server_path(rt, users[0], questions, k)})
            async with engine.begin() as conn:
                await conn.execute(delete(facts).where(facts.c.user_id.in_(users)))
    finally:
        await engine.dispose()
    return {"embed": embed, "search": searches, "loads": loads}


def run(settings: Settings, data: Path, out_dir: Path, n_queries: int = 60,
        ks: tuple[int, ...] = (20, 50)) -> dict:
    """Time ``n_queries`` LoCoMo questions; print and save the report."""
    questions = [q["question"] for sample in json.loads(data.read_text())
                 for q in sample.get("qa", []) if "question" in q][:n_queries]
    result = asyncio.run(_run(settings, questions, ks))
    print_table(["query embedding", "p50 ms", "p90 ms"],
                [[name, r["p50_ms"], r["p90_ms"]] for name, r in result["embed"].items()])
    print_table(["facts per user", "owners", "search", "k", "p50 ms", "p90 ms", "recall@k"],
                [[s["facts_per_user"], s["owners"], s["search"], s["k"], s["p50_ms"], s["p90_ms"],
                  s.get("recall_at_k", "")] for s in result["search"]])
    print_table(["facts per user", "owners", "first load ms", "refresh after 1 new fact ms"],
                [[r["facts_per_user"], r["owners"], r["cold_load_ms"],
                  r["refresh_one_new_fact_ms"]] for r in result["loads"]])
    report = {"questions": len(questions),
              "fact_vectors": "random unit vectors (search cost does not depend on the text)",
              **result}
    write_report(out_dir, "retrieval", report)
    return report
