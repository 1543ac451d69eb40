"""`inferscale demo`: the whole pipeline on embedded defaults, on one machine."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from inferscale import infra, migrate
from inferscale.db.engine import create_engine
from inferscale.db.queries import count_user_rows
from inferscale.embedder import load_embedder
from inferscale.kafka import ensure_topics, publish_turns
from inferscale.retrieval import retrieve
from inferscale.settings import Settings
from inferscale.sources import read_turns
from workers.ingest import IngestWorker

SAMPLE = Path(__file__).parent / "data" / "sample_conversation.json"


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


async def _run(settings: Settings, sample: Path) -> None:
    turns = list(read_turns(sample))
    qa = json.loads(sample.read_text())[0].get("qa", [])
    user = turns[0].user_id
    say(f"publishing {len(turns)} turns of user {user!r} to Kafka topic {settings.turns_topic}")
    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic,
                                                   settings.dead_letter_topic])
    await publish_turns(settings.kafka_bootstrap, settings.turns_topic, turns)
    say("running an ingest worker until the topic is drained (validate, store, embed)")
    engine = create_engine(settings.database_url)
    try:
        embedder = await asyncio.get_running_loop().run_in_executor(
            None, load_embedder, settings.embedder)
        started = time.perf_counter()
        stats = await IngestWorker(settings, settings.kafka_bootstrap, engine, embedder).run(
            drain=True)
        say(f"worker: {stats.consumed} consumed, {stats.turns_stored} new turns, "
            f"{stats.facts_stored} new facts in {time.perf_counter() - started:.1f}s")
        async with engine.connect() as conn:
            n_turns, n_facts = await count_user_rows(conn, user)
        say(f"Postgres holds {n_turns} turns and {n_facts} facts for {user!r}")
        for item in qa[:5]:
            hits = await retrieve(engine, embedder, user, item["question"], 1)
            say(f"Q: {item['question']}\n       top fact: {hits[0].text if hits else '-'}"
                f"\n       gold answer: {item['answer']}")
    finally:
        await engine.dispose()


def run_demo(settings: Settings, sample: Path = SAMPLE, keep: bool = False) -> None:
    """Start the embedded stack, ingest the sample conversation, show retrieval, stop."""
    say(f"starting embedded Kafka (tansu) and Postgres + pgvector in {settings.infra_dir}")
    endpoints = infra.up(settings)
    local = settings.model_copy(update={
        "kafka_bootstrap": settings.kafka_bootstrap or endpoints.kafka_bootstrap,
        "database_url": settings.database_url or endpoints.database_url,
    })
    try:
        say("migrating the schema (alembic upgrade head)")
        migrate.upgrade(local.database_url)
        asyncio.run(_run(local, sample))
    finally:
        if not keep:
            say("stopping the embedded infrastructure")
            infra.down(settings)
