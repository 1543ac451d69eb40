"""Serving under ingest load: memory queries while a load generator publishes turns.

One worker (ingest + encode) and one server share the machine, as a worker and vLLM sharing a
GPU would. Phases of one run: queries alone, then queries while turns of many users arrive at
each target rate. Per phase: query TTFT (inject, k facts) p50/p90; freshness of the generated
turns (publish -> stored, i.e. usable as text; publish -> KV encoded); facts encoded per second.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import text

from inferscale.contracts.events import TurnEvent
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.core.endpoints import resolve_kafka_bootstrap
from inferscale.core.model_prep import resolve_model_path
from inferscale.core.settings import Settings
from inferscale.db.engine import create_engine
from inferscale.devstack.stack import server_process, worker_process
from inferscale.lab.bench.common import percentile, print_table, write_report
from inferscale.lab.bench.throughput import poisson_load
from inferscale.lab.bench.ttft import ingest_user, prepare_user
from inferscale.pipeline.kafka import kafka_security, make_producer
from inferscale.pipeline.sources import read_turns


async def generate_turns(settings: Settings, texts: list[str], prefix: str, users: int,
                         rate: float, duration_s: float, start: int
                         ) -> dict[tuple[str, str], float]:
    """Publish turns round-robin over ``users`` at ``rate`` per second; returns the publish
    wall-clock time of each (user, turn id)."""
    producer = make_producer(resolve_kafka_bootstrap(settings), kafka_security(settings))
    await producer.start()
    published: dict[tuple[str, str], float] = {}
    began = time.monotonic()
    try:
        for n, text in zip(itertools.count(start), itertools.cycle(texts)):
            due = began + (n - start) / rate
            if due - began >= duration_s:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            user = f"{prefix}-{n % users}"
            event = TurnEvent(user_id=user, conversation_id=user, turn_id=f"t{n}", speaker="Kim",
                              text=text, timestamp=datetime.now(UTC))
            await producer.send(settings.turns_topic, event.to_bytes(), key=user.encode())
            published[(user, f"t{n}")] = time.time()
        await producer.flush()
    finally:
        await producer.stop()
    return published


async def _phases(settings: Settings, url: str, user: str, questions: list[str], texts: list[str],
                  rates: tuple[float, ...], users: int, query_rate: float, k: int,
                  duration_s: float, drain_s: float) -> list[dict]:
    prefix = f"load-{uuid.uuid4().hex[:6]}"
    await poisson_load(url, user, questions, "inject", k, query_rate, 5, 0)  # warm-up
    phases: list[dict[str, Any]] = []
    sent = 0
    for rate in rates:
        began = time.time()
        queries = poisson_load(url, user, questions, "inject", k, query_rate, duration_s, 1)
        if rate > 0:
            published, ttfts = await asyncio.gather(generate_turns(
                settings, texts, prefix, users, rate, duration_s, sent), queries)
        else:
            published, ttfts = {}, await queries
        sent += len(published)
        phases.append({"ingest_rate": rate, "began": began, "ended": time.time(),
                       "published": published, "ttfts": ttfts})
        print(f"ingest {rate} turns/s: query TTFT p50 "
              f"{percentile([t for t in ttfts if t is not None], 50):.3f}s", flush=True)
    engine = create_engine(settings.database_url)
    model = model_fingerprint(resolve_model_path(settings))
    try:
        deadline = time.monotonic() + drain_s
        while True:  # let the backlog finish, so freshness covers every generated turn
            async with engine.connect() as conn:
                rows = (await conn.execute(TURN_PROGRESS, {"users": f"{prefix}-%",
                                                           "model": model})).all()
            if (len(rows) == sent and all(r.encoded_at for r in rows)) or (
                    time.monotonic() > deadline):
                break
            await asyncio.sleep(2)
    finally:
        await engine.dispose()
    by_turn = {(r.user_id, r.turn_id): r for r in rows}
    results = []
    for phase in phases:
        stored, encoded, missing = [], [], 0
        for key, at in phase["published"].items():
            row = by_turn.get(key)
            if row is None or row.encoded_at is None:
                missing += 1
            if row is not None and row.created_at is not None:
                stored.append(row.created_at.timestamp() - at)
            if row is not None and row.encoded_at is not None:
                encoded.append(row.encoded_at.timestamp() - at)
        encoded_in_phase = sum(r.facts for r in rows if r.encoded_at and phase["began"]
                               <= r.encoded_at.timestamp() <= phase["ended"])
        ok = [t for t in phase["ttfts"] if t is not None]
        results.append({
            "ingest_rate": phase["ingest_rate"], "turns_published": len(phase["published"]),
            "queries": len(phase["ttfts"]), "queries_failed": len(phase["ttfts"]) - len(ok),
            "ttft_p50_s": percentile(ok, 50), "ttft_p90_s": percentile(ok, 90),
            "stored_p50_s": percentile(stored, 50), "stored_p95_s": percentile(stored, 95),
            "encoded_p50_s": percentile(encoded, 50), "encoded_p95_s": percentile(encoded, 95),
            "not_encoded_by_end": missing,
            "facts_encoded_per_s": encoded_in_phase / (phase["ended"] - phase["began"]),
        })
        print(json.dumps(results[-1]), flush=True)
    return results


# Per turn: when its facts were stored (usable as text) and when the last of them got its KV
# for the served model
# (a turn without facts counts as encoded when extracted); any number of facts per turn.
TURN_PROGRESS = text("""
    SELECT t.user_id, t.turn_id, t.extracted_at AS created_at, count(f.id) AS facts,
           CASE WHEN count(f.id) = 0 THEN t.extracted_at
                WHEN bool_and(k.encoded_at IS NOT NULL) THEN max(k.encoded_at) END AS encoded_at
    FROM turns t LEFT JOIN facts f
      ON f.user_id = t.user_id AND f.conversation_id = t.conversation_id
     AND t.turn_id = ANY(f.turn_ids) AND f.deleted_at IS NULL
    LEFT JOIN fact_kv k ON k.fact_id = f.id AND k.model_fingerprint = :model
    WHERE t.user_id LIKE :users
    GROUP BY t.user_id, t.turn_id, t.extracted_at
""")


def run(settings: Settings, data: Path, out_dir: Path,
        rates: tuple[float, ...] = (0, 1, 2, 4), users: int = 50, query_rate: float = 1.0,
        k: int = 20, duration_s: float = 40, drain_s: float = 240) -> dict:
    """Worker + server; TTFT and freshness per ingest rate (0 = queries alone)."""
    settings, user, questions, turns = prepare_user(settings, data, 100)
    texts = [t.text for t in read_turns(data)]
    out_dir.mkdir(parents=True, exist_ok=True)
    with worker_process(settings, out_dir / "worker.log"):
        ingest_user(settings, user, turns)
        with server_process(settings, out_dir / "server.log") as url:
            rows = asyncio.run(_phases(settings, url, user, questions, texts, rates, users,
                                       query_rate, k, duration_s, drain_s))
    base = rows[0]["ttft_p50_s"]
    table = [[r["ingest_rate"], r["ttft_p50_s"], r["ttft_p90_s"], r["ttft_p50_s"] / base,
              r["stored_p50_s"] or 0.0, r["encoded_p50_s"] or 0.0, r["encoded_p95_s"] or 0.0,
              r["facts_encoded_per_s"]] for r in rows]
    print(f"queries: inject k={k} at {query_rate} req/s; generated turns over {users} users; "
          f"{duration_s:.0f}s per phase; encode duty cycle {settings.encode_duty_cycle}")
    print_table(["ingest turns/s", "TTFT p50", "TTFT p90", "p50 vs alone", "stored p50 s",
                 "KV p50 s", "KV p95 s", "encoded/s"], table)
    report = {"k": k, "query_rate": query_rate, "users": users, "duration_s": duration_s,
              "encode_duty_cycle": settings.encode_duty_cycle, "rows": rows}
    write_report(out_dir, "load", report)
    return report
