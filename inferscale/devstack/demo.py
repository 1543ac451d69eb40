"""`inferscale demo`: the whole pipeline on embedded defaults, on one machine.

Starts the embedded broker and Postgres, prepares SmolLM2, runs a worker process and the vLLM
server with InferScale, publishes the shipped sample conversation to Kafka, waits until its
memory is encoded, then asks questions through the OpenAI API with memory injected as KV and,
side by side, with the same facts prefilled as text. Last, it corrects the fact behind the first
answer through the memory API (``inferscale.client``) and asks again: at once the new version
is served (as text), then, once the worker has encoded it, injected as KV.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import httpx

from inferscale.core.endpoints import resolve_kafka_bootstrap
from inferscale.core.settings import Settings
from inferscale.db.engine import create_engine
from inferscale.devstack import infra
from inferscale.devstack.chat_client import stream_chat
from inferscale.devstack.stack import prepare, server_process, wait_encoded, worker_process
from inferscale.pipeline.kafka import ensure_topics, kafka_security, publish_turns
from inferscale.pipeline.sources import read_turns
from inferscale.serving.request_options import default_recompute

SAMPLE = Path(__file__).parent.parent / "data" / "sample_conversation.json"
CORRECTION = "Captain Inky"  # what the demo's edit puts in place of the first gold answer
ENCODE_WAIT_S = 120.0


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


async def _publish(settings: Settings, turns) -> None:
    bootstrap, security = resolve_kafka_bootstrap(settings), kafka_security(settings)
    await ensure_topics(bootstrap, [settings.turns_topic, settings.dead_letter_topic],
                        security=security)
    await publish_turns(bootstrap, settings.turns_topic, turns, security=security)


async def _wait(settings: Settings, user: str, n: int, worker: subprocess.Popen,
                log: Path) -> float:
    """Seconds until the user's memory is encoded; a worker that dies meanwhile is an error
    naming its log, not a wait without end."""
    engine = create_engine(settings.database_url)
    waiting = asyncio.ensure_future(wait_encoded(engine, user, n, settings))
    try:
        while not waiting.done():
            if worker.poll() is not None:
                raise RuntimeError(f"the worker exited with code {worker.returncode}: see {log}")
            await asyncio.wait([waiting], timeout=1.0)
        return waiting.result()
    finally:
        waiting.cancel()
        await engine.dispose()


async def _ask(url: str, user: str, qa: list[dict], k: int) -> list[dict]:
    rows = []
    async with httpx.AsyncClient(timeout=300) as client:
        await stream_chat(client, url, user, "warm-up", "inject", k)
        await stream_chat(client, url, user, "warm-up", "text", k)
        for item in qa:
            inject = await stream_chat(client, url, user, item["question"], "inject", k, 40)
            text = await stream_chat(client, url, user, item["question"], "text", k, 40)
            rows.append({"question": item["question"], "gold": str(item["answer"]),
                         "inject": inject, "text": text})
            print(f"\nQ: {item['question']}   (gold: {item['answer']})\n"
                  f"   inject [{inject.ttft * 1000:6.0f} ms TTFT, "
                  f"{inject.headers.get('x-inferscale-injected-tokens')} tokens injected]: "
                  f"{inject.text.strip()}\n"
                  f"   text   [{text.ttft * 1000:6.0f} ms TTFT, "
                  f"{text.headers.get('x-inferscale-prefilled-tokens')} tokens prefilled]: "
                  f"{text.text.strip()}", flush=True)
    return rows


async def _edit(url: str, user: str, item: dict, k: int) -> None:
    """Edit the fact holding the first question's gold answer, then ask again: once right after
    the edit (its new version served as text), once after the worker encoded it (as KV)."""
    from inferscale.client import AsyncMemoryClient

    gold = str(item["answer"])
    async with AsyncMemoryClient(url) as memory, httpx.AsyncClient(timeout=300) as client:
        hits = await memory.search(user, item["question"], k=5)
        fact = next((h for h in hits if gold.lower() in h["text"].lower()), None)
        if fact is None:
            say(f"no fact of the top 5 holds {gold!r}: no edit to show")
            return
        start = fact["text"].lower().index(gold.lower())
        text = fact["text"][:start] + CORRECTION + fact["text"][start + len(gold):]
        new = await memory.edit_fact(user, fact["id"], text)
        say(f"edited fact {fact['id']} through the memory API: it is now fact {new['id']}, "
            f"{text!r}")
        began = time.monotonic()
        for stage in ("served as text until encoded", "injected as KV, no tail recompute"):
            options = None
            if stage.startswith("injected"):
                options = {"recompute": 0}  # every fact as KV, the edited one too
                while not (await memory.get_fact(user, new["id"]))["kv"]["encoded"]:
                    if time.monotonic() - began > ENCODE_WAIT_S:
                        say(f"the new version was not encoded within {ENCODE_WAIT_S:.0f}s")
                        return
                    await asyncio.sleep(0.2)
            answer = await stream_chat(client, url, user, item["question"], "inject", k, 40,
                                       options=options)
            used = answer.headers.get("x-inferscale-fact-ids", "").split(",")
            print(f"\nQ: {item['question']}   (after the edit; {stage}; old fact served: "
                  f"{str(fact['id']) in used}, new fact served: {str(new['id']) in used}, "
                  f"{answer.headers.get('x-inferscale-facts-injected')} facts injected)\n"
                  f"   inject: {answer.text.strip()}", flush=True)


def run_demo(settings: Settings, sample: Path = SAMPLE, keep: bool = False, k: int = 10) -> None:
    """Run the whole pipeline once and print answers and TTFT, inject vs text."""
    started = time.monotonic()
    out = settings.data_dir / "demo"
    say(f"starting embedded Kafka (tansu) + Postgres/pgvector, migrating, preparing SmolLM2 "
        f"(data dir {settings.data_dir})")
    local = prepare(settings)
    turns = list(read_turns(sample))
    user = turns[0].user_id
    qa = [q for q in json.loads(sample.read_text())[0].get("qa", []) if q.get("category") != 5]
    try:
        say(f"starting an ingest+encode worker process (log: {out / 'worker.log'})")
        with worker_process(local, out / "worker.log") as worker:
            say(f"publishing {len(turns)} turns of user {user!r} to Kafka")
            asyncio.run(_publish(local, turns))
            say(f"starting vLLM with the InferScale connector (log: {out / 'server.log'}); "
                "first start compiles the model, ~2 min on 2 cores")
            with server_process(local, out / "server.log") as url:
                say("server ready; waiting until every fact has its KV")
                asyncio.run(_wait(local, user, len(turns), worker, out / "worker.log"))
                say(f"asking {len(qa)} questions with k={k}: memory injected as KV (tail "
                    f"recompute: {default_recompute(local)}) vs the same facts prefilled as "
                    "text")
                rows = asyncio.run(_ask(url, user, qa, k))
                if qa:
                    asyncio.run(_edit(url, user, qa[0], k))
        ttft_i = sorted(r["inject"].ttft for r in rows)[len(rows) // 2]
        ttft_t = sorted(r["text"].ttft for r in rows)[len(rows) // 2]
        hits = {mode: sum(r["gold"].lower() in r[mode].text.lower() for r in rows)
                for mode in ("inject", "text")}
        say(f"median TTFT inject {ttft_i * 1000:.0f} ms vs text {ttft_t * 1000:.0f} ms "
            f"({ttft_t / ttft_i:.2f}x); gold answer contained in {hits['inject']}/{len(rows)} "
            f"inject and {hits['text']}/{len(rows)} text answers; "
            f"total {time.monotonic() - started:.0f}s")
    finally:
        if not keep and not (settings.kafka_bootstrap and settings.database_url):
            say("stopping the embedded infrastructure")
            infra.down(settings)
