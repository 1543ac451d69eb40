"""Test helpers shared by the integration suites."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, ConsumerRecord

from conftest import SAMPLE
from inferscale.contracts.events import TurnEvent
from inferscale.pipeline.sources import read_turns


def build_wheel(source: Path, out: Path) -> Path:
    """The wheel of the project at ``source`` (a copy: no build files left in the tree)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-q", "-w", str(out), str(source)],
                   check=True, timeout=600)
    (built,) = out.glob("*.whl")
    return built


def sample_turns(user_id: str | None = None) -> list[TurnEvent]:
    """The shipped sample conversation, owned by a fresh (or the given) user id."""
    user_id = user_id or f"user-{uuid.uuid4().hex[:8]}"
    return [t.model_copy(update={"user_id": user_id, "conversation_id": user_id})
            for t in read_turns(SAMPLE)]


async def read_topic(bootstrap: str, topic: str, expected: int, timeout_s: float = 20,
                     security: dict | None = None) -> list[ConsumerRecord]:
    """Read a topic from the beginning until ``expected`` records arrived (or time runs out);
    ``security``: ``kafka_security``'s."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                **(security or {}))
    await consumer.start()
    records: list[ConsumerRecord] = []
    try:
        async with asyncio.timeout(timeout_s):
            while len(records) < expected:
                batch = await consumer.getmany(timeout_ms=500)
                records += [r for part in batch.values() for r in part]
    except TimeoutError:
        pass
    finally:
        await consumer.stop()
    return records


async def extract_all(settings, engine, embedder, extractor=None, decide=None, **kwargs):
    """Drain the extract stage (``turn`` extractor unless given) over every stored turn."""
    from inferscale.pipeline.extraction import TurnExtractor
    from inferscale.workers.extract import ExtractWorker

    return await ExtractWorker(settings, engine, embedder, extractor or TurnExtractor(), decide,
                               **kwargs).run(drain=True)


async def ingest(settings, engine, turns) -> None:
    """Publish turns and drain the ingest stage."""
    from inferscale.pipeline.kafka import ensure_topics, kafka_security, publish_turns
    from inferscale.workers.ingest import IngestWorker

    security = kafka_security(settings)
    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic], security=security)
    await publish_turns(settings.kafka_bootstrap, settings.turns_topic, turns, progress=False,
                        security=security)
    await IngestWorker(settings, settings.kafka_bootstrap, engine).run(drain=True)


async def ingest_and_encode(settings, engine, embedder, turns, encoder=None, store=None) -> None:
    """Publish turns, drain the ingest and extract stages, then (optionally) encode every
    pending fact."""
    from inferscale.workers.encode import EncodeWorker

    await ingest(settings, engine, turns)
    await extract_all(settings, engine, embedder)
    if encoder is not None:
        await EncodeWorker(settings, engine, encoder, store).run(drain=True)


async def ines_with_two_facts(served, smol, base_settings, engine, embedder, prefix: str
                              ) -> str:
    """A new owner (``prefix``-...) with two encoded facts on the served model (a horse called
    Biscuit, chemistry in Porto), ingested through topics of their own."""
    encoder, store = smol
    user = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cfg = base_settings.model_copy(update={
        "turns_topic": f"turns-{user}", "dead_letter_topic": f"turns-{user}.dlq",
        "consumer_group": f"ingest-{user}", **{k: getattr(served.settings, k) for k in (
            "model_path", "kv_dir", "data_dir", "window", "top_k")}})
    await ingest_and_encode(cfg, engine, embedder, [
        turn(user, "t1", "Ines", "My horse is called Biscuit and she is twelve years old."),
        turn(user, "t2", "Ines", "I teach chemistry at a school in Porto.")], encoder, store)
    return user


def turn(user: str, turn_id: str, speaker: str, text: str, day: int = 1) -> TurnEvent:
    """A hand-made turn of a one-conversation user."""
    from datetime import UTC, datetime

    return TurnEvent(user_id=user, conversation_id=user, turn_id=turn_id, speaker=speaker,
                     text=text, timestamp=datetime(2025, 5, day, 12, 0, tzinfo=UTC))


def tokens_and_logprobs(response) -> tuple[list[str], list[dict[str, float]]]:
    """A 200 chat completion's tokens and, per token, its top logprobs by token."""
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    return ([c["token"] for c in content],
            [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content])


def max_logprob_diff(a: list[dict[str, float]], b: list[dict[str, float]]) -> float:
    """The largest difference of a token's logprob present in both, position by position;
    infinite where no position shares a token (as far apart as they can be)."""
    return max((abs(x[t] - y[t]) for x, y in zip(a, b, strict=True) for t in x if t in y),
               default=math.inf)


def metric(server, name: str, **labels: str) -> float:
    """A running server's Prometheus metric, summed over its label sets (those with every one
    of ``labels``)."""
    import httpx

    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#")
               and all(label in line for label in wanted))
