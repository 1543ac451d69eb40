"""Retrieval latency: query embedding (torch vs ONNX Runtime) and pgvector top-k of one owner's
facts (1k or 10k facts per user, 2 or 20 owners), against the real Postgres: the server's exact
search and, on the same rows, the global HNSW index it had before migration 0007."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from sqlalchemy import delete, text, update
from sqlalchemy.ext.asyncio import create_async_engine

from inferscale.bench.common import percentile, print_table, write_report
from inferscale.db.engine import create_engine
from inferscale.db.queries import NewFact, upsert_facts
from inferscale.db.tables import facts
from inferscale.embedder import Embedder, load_embedder
from inferscale.retrieval import search
from inferscale.settings import Settings

# (facts per user, owners): the measured owner and others with as many facts each.
SCENARIOS = ((1_000, 2), (10_000, 2), (1_000, 20))
WARMUP = 5
# An encoded fact's row as the server reads it: a LoCoMo-sized text, ~40 token ids, its blob's
# location and checksums (row width decides how many pages an exact scan reads).
TEXT = "2023-05-08 Caroline: I went to a LGBTQ support group yesterday and it was so powerful. "
TOKEN_IDS = list(range(1000, 1040))
HNSW_INDEX = "bench_retrieval_hnsw"


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


async def _store(engine, users: list[str], n: int, rng: np.random.Generator) -> np.ndarray:
    """n random unit vectors per user as encoded facts "fact <i> ..."; the first user's
    vectors."""
    stored = []
    for user in users:
        vectors = rng.standard_normal((n, 384)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        for start in range(0, n, 2000):
            rows = [NewFact(user, "bench", (f"t{i}",), 0, "bench", f"fact {i} {TEXT}",
                            datetime.now(UTC), vectors[i].tolist())
                    for i in range(start, min(start + 2000, n))]
            async with engine.begin() as conn:
                await upsert_facts(conn, rows)
        stored.append(vectors)
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(update(facts).where(facts.c.user_id.in_(users)).values(
            token_ids=TOKEN_IDS, kv_location="kv/" + "0" * 40, kv_checksum="0" * 64,
            kv_lead_checksum="0" * 64))
        await conn.execute(text("VACUUM ANALYZE facts"))  # the steady state after encoding
    return stored[0]


async def _searches(engine, user: str, facts: np.ndarray, queries: np.ndarray, k: int
                    ) -> tuple[list[float], float]:
    """Latency of the server's search per query (after warm-up) and its mean recall@k against
    the exact top-k of the owner's facts."""
    samples, recalls = [], []
    for i, query in enumerate(queries):
        began = time.perf_counter()
        hits = await search(engine, user, query.tolist(), k)
        if i >= WARMUP:
            samples.append(time.perf_counter() - began)
        exact = {int(j) for j in np.argsort(-(facts @ query), kind="stable")[:k]}
        recalls.append(len(exact & {int(hit.text.split()[1]) for hit in hits}) / k)
    return samples, statistics.mean(recalls)


async def _run(settings: Settings, questions: list[str], ks: tuple[int, ...]) -> dict:
    fast, slow = load_embedder(settings), Embedder()
    embed = {"onnx": _ms(_timed(lambda q: fast.encode([q]), questions)),
             "torch": _ms(_timed(lambda q: slow.encode([q]), questions))}
    vectors = fast.encode(questions)
    engine = create_engine(settings=settings)
    # The design before migration 0007: a global HNSW index, scanned on until enough rows pass
    # the owner filter (iterative scan, relaxed order, set per connection).
    hnsw = create_async_engine(engine.url, connect_args={
        "server_settings": {"hnsw.iterative_scan": "relaxed_order"}})
    rng, searches = np.random.default_rng(0), []
    try:
        for n, owners in SCENARIOS:
            users = [f"bench-retrieval-{uuid.uuid4().hex[:8]}" for _ in range(owners)]
            facts_of_first = await _store(engine, users, n, rng)
            for search_with, label in ((engine, "exact"), (hnsw, "hnsw")):
                if label == "hnsw":
                    async with engine.begin() as conn:
                        await conn.execute(text(f"CREATE INDEX {HNSW_INDEX} ON facts USING hnsw "
                                                "(embedding vector_cosine_ops)"))
                for k in ks:
                    samples, recall = await _searches(search_with, users[0], facts_of_first,
                                                      vectors, k)
                    searches.append({"facts_per_user": n, "owners": owners, "index": label,
                                     "k": k, **_ms(samples), "recall_at_k": recall})
            async with engine.begin() as conn:
                await conn.execute(text(f"DROP INDEX {HNSW_INDEX}"))
                await conn.execute(delete(facts).where(facts.c.user_id.in_(users)))
    finally:
        async with engine.begin() as conn:
            await conn.execute(text(f"DROP INDEX IF EXISTS {HNSW_INDEX}"))
        await engine.dispose()
        await hnsw.dispose()
    return {"embed": embed, "search": searches}


def run(settings: Settings, data: Path, out_dir: Path, n_queries: int = 60,
        ks: tuple[int, ...] = (20, 50)) -> dict:
    """Time ``n_queries`` LoCoMo questions; print and save the report."""
    questions = [q["question"] for sample in json.loads(data.read_text())
                 for q in sample.get("qa", []) if "question" in q][:n_queries]
    result = asyncio.run(_run(settings, questions, ks))
    print_table(["query embedding", "p50 ms", "p90 ms"],
                [[name, r["p50_ms"], r["p90_ms"]] for name, r in result["embed"].items()])
    print_table(["facts per user", "owners", "search", "k", "p50 ms", "p90 ms", "recall@k",
                 "embed (onnx) + search p50"],
                [[s["facts_per_user"], s["owners"], s["index"], s["k"], s["p50_ms"], s["p90_ms"],
                  s["recall_at_k"], s["p50_ms"] + result["embed"]["onnx"]["p50_ms"]]
                 for s in result["search"]])
    report = {"questions": len(questions),
              "fact_vectors": "random unit vectors (search cost does not depend on the text)",
              **result}
    write_report(out_dir, "retrieval", report)
    return report
