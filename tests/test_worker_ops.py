"""Worker operations on the real broker and Postgres: back-pressure, health and metrics."""

import asyncio
import socket

import httpx

from helpers import sample_turns
from inferscale.db.queries import count_user_rows
from inferscale.kafka import ensure_topics, publish_turns
from workers.ingest import IngestWorker
from workers.observe import HealthServer


async def test_back_pressure_pauses_then_resumes(settings, engine, embedder):
    turns = sample_turns()
    user = turns[0].user_id
    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic])
    await publish_turns(settings.kafka_bootstrap, settings.turns_topic, turns, progress=False)
    backlog = {"pending": 10**6}

    async def pending() -> int:
        return backlog["pending"]

    worker = IngestWorker(settings.model_copy(update={"max_pending_facts": 100}),
                          settings.kafka_bootstrap, engine, embedder, backlog=pending)
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(6)  # group join (~1 s with 2 s sessions) + several polls while paused
    async with engine.connect() as conn:
        assert await count_user_rows(conn, user) == (0, 0)
    assert worker.stats.consumed == 0
    backlog["pending"] = 0
    for _ in range(60):
        async with engine.connect() as conn:
            if await count_user_rows(conn, user) == (len(turns), len(turns)):
                break
        await asyncio.sleep(0.5)
    worker.request_stop()
    await task
    assert worker.stats.turns_stored == len(turns)


async def test_health_and_metrics_endpoints():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    health = HealthServer()
    await health.start("127.0.0.1", port)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/readyz")).status_code == 503
            health.ready = True
            assert (await client.get("/readyz")).status_code == 200
            metrics = (await client.get("/metrics")).text
            assert "inferscale_worker_consumed_total" in metrics
            assert "inferscale_worker_lag" in metrics or "inferscale_worker_paused" in metrics
    finally:
        await health.stop()
