"""Kafka plumbing shared by the publisher and the workers: client security, topics and
producers."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError
from aiokafka.helpers import create_ssl_context
from tqdm import tqdm

from inferscale.contracts.events import TurnEvent
from inferscale.core.settings import Settings

TOPIC_EXISTS = TopicAlreadyExistsError.errno


def kafka_security(settings: Settings) -> dict[str, Any]:
    """The aiokafka keyword arguments for the settings' broker security (none for PLAINTEXT):
    every Kafka client InferScale builds takes them. ``ValueError`` for TLS files that do not
    load."""
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return {}
    options: dict[str, Any] = {"security_protocol": protocol}
    if protocol.startswith("SASL_"):
        password = settings.kafka_sasl_password
        options |= {"sasl_mechanism": settings.kafka_sasl_mechanism,
                    "sasl_plain_username": settings.kafka_sasl_username,
                    "sasl_plain_password": password.get_secret_value() if password else None}
    if protocol.endswith("SSL"):
        try:
            options["ssl_context"] = create_ssl_context(
                cafile=settings.kafka_ssl_cafile, certfile=settings.kafka_ssl_certfile,
                keyfile=settings.kafka_ssl_keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError("cannot load kafka_ssl_cafile / kafka_ssl_certfile / "
                             f"kafka_ssl_keyfile: {exc}") from exc
    return options


async def ensure_topics(bootstrap: str, topics: Iterable[str], partitions: int = 4,
                        security: dict[str, Any] | None = None) -> None:
    """Create the topics if missing (idempotent); ``security``: ``kafka_security``'s."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **(security or {}))
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


def make_producer(bootstrap: str, security: dict[str, Any] | None = None) -> AIOKafkaProducer:
    """A producer that waits for the leader to persist every record and retries on errors."""
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=5, request_timeout_ms=30_000,
        retry_backoff_ms=200, **(security or {}),
    )


async def publish_turns(
    bootstrap: str, topic: str, turns: Iterable[TurnEvent], progress: bool = True,
    security: dict[str, Any] | None = None,
) -> int:
    """Publish turn events keyed by user_id; returns how many the broker acknowledged."""
    producer = make_producer(bootstrap, security)
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
