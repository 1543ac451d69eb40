"""Fault drills with real processes, the real broker and the real Postgres.

- ``kill -9`` of worker processes at random points while turns stream in: every turn stored
  once, every fact encoded once with exactly one verified blob, no temp file left behind.
- a Postgres restart in the middle of consumption: the worker retries and loses nothing.
"""

import asyncio
import os
import random
import signal
import subprocess
import sys
import uuid

import pytest
from sqlalchemy import func, select

from conftest import EXTERNAL_INFRA
from helpers import turn
from inferscale import infra
from inferscale.db.tables import facts, turns
from inferscale.fingerprint import model_fingerprint
from inferscale.kafka import ensure_topics, publish_turns
from inferscale.kvstore import KVStore
from inferscale.stack import settings_env
from workers.ingest import IngestWorker

pytestmark = pytest.mark.slow


def _events(prefix: str, users: int, per_user: int):
    return [turn(f"{prefix}-{u}", f"t{i}", "Kim", f"On day {i} user {u} noted item {i * 7}.",
                 day=1 + i % 28) for u in range(users) for i in range(per_user)]


async def _counts(engine, prefix: str) -> tuple[int, int, int]:
    async with engine.connect() as conn:
        n_turns = await conn.scalar(select(func.count()).where(
            turns.c.user_id.like(f"{prefix}-%")))
        n_facts = await conn.scalar(select(func.count()).where(
            facts.c.user_id.like(f"{prefix}-%")))
        n_encoded = await conn.scalar(select(func.count()).where(
            facts.c.user_id.like(f"{prefix}-%"), facts.c.kv_location.is_not(None)))
    return n_turns, n_facts, n_encoded


async def test_kill_9_workers_lose_and_duplicate_nothing(settings, engine, tiny_models, tmp_path):
    prefix = f"kill-{uuid.uuid4().hex[:6]}"
    events = _events(prefix, users=25, per_user=40)
    cfg = settings.model_copy(update={
        "model_path": tiny_models["llama"], "kv_dir": tmp_path / "kv", "data_dir": tmp_path,
        "window": 2, "ingest_batch_size": 50, "encode_batch_size": 16})
    env = {**settings_env(cfg), "INFERSCALE_KAFKA_SESSION_TIMEOUT_MS": "3000"}
    await ensure_topics(cfg.kafka_bootstrap, [cfg.turns_topic, cfg.dead_letter_topic])

    async def stream_in():
        for start in range(0, len(events), 100):
            await publish_turns(cfg.kafka_bootstrap, cfg.turns_topic,
                                events[start:start + 100], progress=False)
            await asyncio.sleep(0.5)

    publisher = asyncio.create_task(stream_in())
    rng = random.Random(1)
    kills = 0
    for _ in range(5):
        worker = subprocess.Popen([sys.executable, "-m", "inferscale.cli", "worker"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await asyncio.sleep(rng.uniform(6, 12))
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        kills += 1
    await publisher
    progress_after_kills = await _counts(engine, prefix)
    assert progress_after_kills[0] > 0, "the killed workers never stored anything"
    final = subprocess.Popen([sys.executable, "-m", "inferscale.cli", "worker"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            if await _counts(engine, prefix) == (len(events),) * 3:
                break
            await asyncio.sleep(0.5)
    finally:
        final.terminate()
        final.wait(60)
    assert kills == 5
    assert await _counts(engine, prefix) == (len(events),) * 3
    async with engine.connect() as conn:
        rows = (await conn.execute(select(facts.c.id, facts.c.kv_location, facts.c.kv_checksum)
                                   .where(facts.c.user_id.like(f"{prefix}-%")))).all()
    store = KVStore(cfg.kv_path, model_fingerprint(tiny_models["llama"]), host_bytes=0)
    assert len({r.kv_location for r in rows}) == len(events)
    for row in rows:
        store.get(row.kv_location, row.kv_checksum)  # verifies content and fingerprint
    blob_names = {p.name for p in cfg.kv_path.rglob("*.safetensors")} - {"preamble.safetensors"}
    assert blob_names == {f"{r.id}.safetensors" for r in rows}  # no orphans, no duplicates
    assert not list(cfg.kv_path.rglob("*.tmp"))


@pytest.mark.skipif(EXTERNAL_INFRA, reason="restarts the embedded Postgres")
async def test_postgres_restart_mid_stream_loses_nothing(base_settings, settings, engine,
                                                         embedder):
    prefix = f"pg-{uuid.uuid4().hex[:6]}"
    events = _events(prefix, users=10, per_user=30)
    cfg = settings.model_copy(update={"ingest_batch_size": 10})
    await ensure_topics(cfg.kafka_bootstrap, [cfg.turns_topic])
    await publish_turns(cfg.kafka_bootstrap, cfg.turns_topic, events, progress=False)
    worker = IngestWorker(cfg, cfg.kafka_bootstrap, engine, embedder)
    task = asyncio.create_task(worker.run())
    while worker.stats.turns_stored == 0:
        await asyncio.sleep(0.1)
    local = base_settings.model_copy(update={"kafka_bootstrap": None, "database_url": None})
    await asyncio.to_thread(infra.restart_postgres, local)
    for _ in range(240):
        try:
            if (await _counts(engine, prefix))[:2] == (len(events), len(events)):
                break
        except Exception:  # noqa: BLE001 - the test's own pool reconnects after the restart
            pass
        await asyncio.sleep(0.5)
    worker.request_stop()
    await task
    assert (await _counts(engine, prefix))[:2] == (len(events), len(events))
    assert worker.stats.consumed >= len(events)
