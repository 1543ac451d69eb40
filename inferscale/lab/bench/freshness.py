"""Freshness: a turn published to Kafka -> the first query whose prompt uses its fact."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
from sqlalchemy import and_, select

from inferscale.contracts.events import TurnEvent
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.core.endpoints import resolve_kafka_bootstrap
from inferscale.core.model_prep import resolve_model_path
from inferscale.core.settings import Settings
from inferscale.db.engine import create_engine
from inferscale.db.tables import fact_kv, facts, turns
from inferscale.devstack.chat_client import stream_chat
from inferscale.devstack.stack import prepare, server_process, worker_process
from inferscale.lab.bench.common import percentile, print_table, write_report
from inferscale.pipeline.kafka import ensure_topics, kafka_security, make_producer


async def _fresh(settings: Settings, url: str, n: int, poll_s: float) -> list[dict]:
    user = f"fresh-{uuid.uuid4().hex[:6]}"
    engine = create_engine(settings.database_url)
    model = model_fingerprint(resolve_model_path(settings))  # the worker's and the server's
    producer = make_producer(resolve_kafka_bootstrap(settings), kafka_security(settings))
    await producer.start()
    results = []
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            await stream_chat(client, url, user, "warm-up", "inject", 5, max_tokens=1)
            for i in range(n):
                code = f"{uuid.uuid4().hex[:6]}"
                event = TurnEvent(user_id=user, conversation_id=user, turn_id=f"t{i}",
                                  speaker="Kim", text=f"My locker code number {i} is {code}.",
                                  timestamp=datetime.now(UTC))
                published, published_wall = time.perf_counter(), datetime.now(UTC)
                await producer.send_and_wait(settings.turns_topic, event.to_bytes(),
                                             key=user.encode())
                fact_id = injected_at = used_at = None
                probes: list[float] = []
                while injected_at is None and time.perf_counter() - published < 300:
                    if fact_id is None:
                        async with engine.connect() as conn:
                            fact_id = await conn.scalar(select(facts.c.id).where(
                                facts.c.user_id == user, facts.c.turn_ids == [f"t{i}"]))
                    probe_began = time.perf_counter()
                    result = await stream_chat(client, url, user,
                                               f"What is locker code number {i}?", "inject", 50,
                                               max_tokens=1)
                    probes.append(time.perf_counter() - probe_began)
                    ids = result.headers.get("x-inferscale-fact-ids", "").split(",")
                    injected = int(result.headers.get("x-inferscale-facts-injected", 0))
                    if fact_id is not None and str(fact_id) in ids:
                        used_at = used_at or time.perf_counter() - published
                        if str(fact_id) in ids[:injected]:
                            injected_at = time.perf_counter() - published
                    await asyncio.sleep(poll_s)
                stages = await _stage_times(engine, model, user, f"t{i}", published_wall)
                results.append({"turn": i, "used_as_text_s": used_at, "injected_s": injected_at,
                                **stages, "probes": len(probes),
                                "probe_mean_s": sum(probes) / max(len(probes), 1)})
                print(f"turn {i}: in a prompt after {used_at:.2f}s, injected as KV after "
                      f"{injected_at:.2f}s; worker: {stages}", flush=True)
    finally:
        await producer.stop()
        await engine.dispose()
    return results


async def _stage_times(engine, model: str, user: str, turn_id: str, published: datetime
                       ) -> dict[str, float | None]:
    """When the worker stored the turn, extracted it, stored its fact and encoded it, in seconds
    after publishing (the database's clock; a batch's rows share its transaction's time)."""
    async with engine.connect() as conn:
        turn = (await conn.execute(select(turns.c.created_at, turns.c.extracted_at).where(
            turns.c.user_id == user, turns.c.turn_id == turn_id))).first()
        fact = (await conn.execute(select(facts.c.created_at, fact_kv.c.encoded_at).select_from(
            facts.outerjoin(fact_kv, and_(fact_kv.c.fact_id == facts.c.id,
                                          fact_kv.c.model_fingerprint == model))).where(
            facts.c.user_id == user, facts.c.turn_ids == [turn_id]))).first()
    times = {"stored_s": turn and turn.created_at, "extracted_s": turn and turn.extracted_at,
             "fact_stored_s": fact and fact.created_at, "encoded_s": fact and fact.encoded_at}
    return {name: None if at is None else round((at - published).total_seconds(), 3)
            for name, at in times.items()}


def run(settings: Settings, out_dir: Path, n: int = 20, poll_s: float = 0.05) -> dict:
    """Worker + server running; publish ``n`` turns one at a time and poll until used."""
    settings = prepare(settings)
    with worker_process(settings, out_dir / "worker.log"), server_process(
            settings, out_dir / "server.log") as url:
        asyncio.run(ensure_topics(resolve_kafka_bootstrap(settings), [settings.turns_topic],
                                  security=kafka_security(settings)))
        results = asyncio.run(_fresh(settings, url, n, poll_s))
    used = [r["used_as_text_s"] for r in results]
    injected = [r["injected_s"] for r in results if r["injected_s"] is not None]

    rows = [["in a prompt (text or KV)", percentile(used, 50), percentile(used, 95)],
            ["injected as KV", percentile(injected, 50), percentile(injected, 95)]]
    for stage in ("stored_s", "extracted_s", "fact_stored_s", "encoded_s", "probe_mean_s"):
        values = [r[stage] for r in results if r[stage] is not None]
        if values:
            rows.append([f"worker: {stage}" if stage != "probe_mean_s" else "one probe query",
                         percentile(values, 50), percentile(values, 95)])
    print_table(["publish -> first query using the fact", "p50 s", "p95 s"], rows)
    report = {"n": n, "results": results, "p50_used_s": rows[0][1], "p95_used_s": rows[0][2],
              "p50_injected_s": rows[1][1], "p95_injected_s": rows[1][2]}
    write_report(out_dir, "freshness", report)
    return report
