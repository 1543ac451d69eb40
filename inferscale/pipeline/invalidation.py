"""Cache invalidations over Kafka: every server purges forgotten blobs from its memory tiers.

Whoever removes blobs (``inferscale forget``, the forget route of any server) publishes one
record (key = user_id, value = ``{"user_id", "locations"}``) to the invalidation topic; every
server consumes the topic from its own start, purges the named blobs from its vLLM workers'
host/device tiers and resets vLLM's prefix cache. Purging a blob a server never held is a no-op.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

from inferscale.pipeline.kafka import ensure_topics, make_producer

log = logging.getLogger("inferscale.pipeline.invalidation")

Purge = Callable[[list[str]], Awaitable[object]]  # what it returns is not used


async def publish_invalidation(bootstrap: str, topic: str, user_id: str, locations: list[str],
                               security: dict[str, Any] | None = None) -> None:
    """Tell every server to drop these blobs from memory; ``security``: ``kafka_security``'s."""
    await ensure_topics(bootstrap, [topic], partitions=1, security=security)
    producer = make_producer(bootstrap, security)
    await producer.start()
    try:
        await producer.send_and_wait(topic, json.dumps(
            {"user_id": user_id, "locations": locations}).encode(), key=user_id.encode())
    finally:
        await producer.stop()


def parse_invalidation(raw: bytes | None) -> list[str]:
    """The blob locations of one invalidation record ([] for anything malformed)."""
    try:
        locations = json.loads(raw or b"").get("locations")
    except (ValueError, RecursionError, AttributeError):
        return []
    if not isinstance(locations, list):
        return []
    return [loc for loc in locations if isinstance(loc, str)]


async def consume_invalidations(bootstrap: str, topic: str, purge: Purge, retry_s: float = 2.0,
                                security: dict[str, Any] | None = None) -> None:
    """Apply every invalidation published since this call began, until cancelled; survives
    broker outages (reconnects) and malformed records (skipped)."""
    since_ms = int(time.time() * 1000) - 5_000  # tolerate a little clock skew
    while True:
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None,
                                    auto_offset_reset="earliest", enable_auto_commit=False,
                                    **(security or {}))
        try:
            await ensure_topics(bootstrap, [topic], partitions=1, security=security)
            await consumer.start()
            while True:
                batch = await consumer.getmany(timeout_ms=1000)
                locations = [loc for records in batch.values() for r in records
                             if r.timestamp >= since_ms for loc in parse_invalidation(r.value)]
                if not locations:
                    continue
                try:
                    await purge(sorted(set(locations)))
                except Exception:  # noqa: BLE001 - a failed purge must not stop later ones
                    log.exception("purging %d invalidated blobs failed", len(locations))
        except (KafkaError, OSError) as exc:
            log.warning("invalidation consumer: %s; reconnecting in %.0fs", exc, retry_s)
        finally:
            await consumer.stop()
        await asyncio.sleep(retry_s)
