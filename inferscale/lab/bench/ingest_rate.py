"""Ingest throughput: turns/s stored and facts/s encoded with 1 and 2 worker processes."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime
from pathlib import Path

from sqlalchemy import and_, func, select

from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.core.endpoints import resolve_kafka_bootstrap
from inferscale.core.model_prep import resolve_model_path
from inferscale.core.settings import Settings
from inferscale.db.engine import create_engine
from inferscale.db.tables import fact_kv, facts, turns
from inferscale.devstack.stack import prepare, worker_process
from inferscale.lab.bench.common import percentile, print_table, write_report
from inferscale.pipeline.kafka import ensure_topics, kafka_security, publish_turns
from inferscale.pipeline.sources import read_turns


async def _one_run(settings: Settings, events, timeout_s: float) -> dict:
    engine = create_engine(settings.database_url)
    model = model_fingerprint(resolve_model_path(settings))  # the workers'
    users = sorted({e.user_id for e in events})
    try:
        bootstrap, security = resolve_kafka_bootstrap(settings), kafka_security(settings)
        await ensure_topics(bootstrap, [settings.turns_topic, settings.dead_letter_topic],
                            security=security)
        published = time.time()
        t0 = time.perf_counter()
        await publish_turns(bootstrap, settings.turns_topic, events, progress=False,
                            security=security)
        stored_at = encoded_at = None
        n_encoded = 0
        while time.perf_counter() - t0 < timeout_s:
            async with engine.connect() as conn:
                n_turns, n_extracted = (await conn.execute(select(
                    func.count(), func.count(turns.c.extracted_at)).where(
                    turns.c.user_id.in_(users)))).one()
                n_facts, n_encoded = (await conn.execute(select(
                    func.count(), func.count(fact_kv.c.kv_location)).select_from(
                    facts.outerjoin(fact_kv, and_(fact_kv.c.fact_id == facts.c.id,
                                                  fact_kv.c.model_fingerprint == model))).where(
                    facts.c.user_id.in_(users), facts.c.deleted_at.is_(None)))).one()
            if stored_at is None and n_turns >= len(events):
                stored_at = time.perf_counter() - t0
            if n_extracted >= len(events) and n_encoded >= n_facts:  # any facts per turn
                encoded_at = time.perf_counter() - t0
                break
            await asyncio.sleep(0.25)
        async with engine.connect() as conn:
            created = (await conn.execute(select(turns.c.created_at).where(
                turns.c.user_id.in_(users)))).scalars().all()
        latencies = [(c.timestamp() if isinstance(c, datetime) else c) - published
                     for c in created]
    finally:
        await engine.dispose()
    return {"turns": len(events), "stored_s": stored_at, "encoded_s": encoded_at,
            "turns_per_s": len(events) / stored_at if stored_at else None,
            "facts_encoded_per_s": n_encoded / encoded_at if encoded_at else None,
            "publish_to_stored_p50_s": percentile(latencies, 50),
            "publish_to_stored_p95_s": percentile(latencies, 95)}


def run(settings: Settings, data: Path, out_dir: Path, limit: int = 400,
        workers: tuple[int, ...] = (1, 2), timeout_s: float = 1800) -> dict:
    """For each worker count: fresh topic and group, publish, wait for stored and encoded."""
    settings = prepare(settings)
    base = list(read_turns(data))[:limit]
    results = []
    for n in workers:
        tag = uuid.uuid4().hex[:6]
        run_settings = settings.model_copy(update={
            "turns_topic": f"bench-ingest-{tag}", "consumer_group": f"bench-ingest-{tag}",
            "dead_letter_topic": f"bench-ingest-{tag}.dlq"})
        events = [e.model_copy(update={"user_id": f"{e.user_id}-{tag}",
                                       "conversation_id": f"{e.conversation_id}-{tag}"})
                  for e in base]
        procs = [worker_process(run_settings, out_dir / f"worker-{n}-{i}.log", sharing=n)
                 for i in range(n)]
        for p in procs:
            p.__enter__()
        try:
            time.sleep(20)  # model + embedder load, group join
            result = asyncio.run(_one_run(run_settings, events, timeout_s))
        finally:
            for p in procs:
                p.__exit__(None, None, None)
        results.append({"workers": n, **result})
        print(f"{n} worker(s): {result}", flush=True)
    print_table(["workers", "turns", "turns/s", "facts encoded/s", "p50 stored s",
                 "p95 stored s"],
                [[r["workers"], r["turns"], r["turns_per_s"] or 0.0,
                  r["facts_encoded_per_s"] or 0.0, r["publish_to_stored_p50_s"],
                  r["publish_to_stored_p95_s"]] for r in results])
    report = {"window": settings.window, "durable_tier": settings.kv_url or str(settings.kv_path),
              "results": results}
    write_report(out_dir, "ingest", report)
    return report
