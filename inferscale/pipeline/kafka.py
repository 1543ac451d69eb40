"""Kafka plumbing shared by the publisher and the workers: topics and producers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError
from tqdm import tqdm

from inferscale.contracts.events import TurnEvent

TOPIC_EXISTS = TopicAlreadyExistsError.errno


async def ensure_topics(bootstrap: str, topics: Iterable[str], partitions: int = 4) -> None:
    """Create the topics if missing (idempotent)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        response = await admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1) for name in topics]
        )
        for name, code, message in (e[:3] for e in response.topic_errors):
            if code not in (0, TOPIC_EXISTS):
                raise RuntimeError(f"cannot create topic {name}: {code} {message}")
    finally:
        await admin.close()


def make_producer(bootstrap: str) -> AIOKafkaProducer:
    """A producer that waits for the leader to persist every record and retries on errors."""
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=5, request_timeout_ms=30_000,
        retry_backoff_ms=200,
    )


async def publish_turns(
    bootstrap: str, topic: str, turns: Iterable[TurnEvent], progress: bool = True
) -> int:
    """Publish turn events keyed by user_id; returns how many the broker acknowledged."""
    producer = make_producer(bootstrap)
    await producer.start()
    count = 0
    try:
        pending: list[asyncio.Future] = []
        with tqdm(desc="published", unit="turn", disable=not progress) as bar:
            for turn in turns:
                key = turn.user_id.encode()
                pending.append(await producer.send(topic, turn.to_bytes(), key=key))
                if len(pending) >= 500:
                    await asyncio.gather(*pending)
                    bar.update(len(pending))
                    count += len(pending)
                    pending.clear()
            await asyncio.gather(*pending)
            bar.update(len(pending))
            count += len(pending)
    finally:
        await producer.stop()
    return count
