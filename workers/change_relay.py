"""Change relay stage: publishes the change outbox (``db/change_outbox.py``) to the change topic
(``contracts/change_events.py``), in order, one relay at a time across workers.

A batch is taken, published (every record acknowledged by the broker) and dropped in one
database transaction: a crash or a broker error before the drop leaves the rows, which the next
batch publishes again (at least once; ``change_id`` lets consumers skip what they applied). A
broker that cannot be reached is logged and tried again at the next poll; the stage never dies
of it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from sqlalchemy.ext.asyncio import AsyncEngine

from inferscale.core import failpoints
from inferscale.core.settings import Settings
from inferscale.db.change_outbox import drop_changes, pending_changes, take_changes
from inferscale.pipeline.kafka import ensure_topics, make_producer
from inferscale.workers import observe
from inferscale.workers.stage import BatchStage

log = logging.getLogger("inferscale.changes")
BATCH = 500


class ChangeRelay(BatchStage):
    """The outbox to the change topic, a batch at a time."""

    def __init__(self, settings: Settings, engine: AsyncEngine, bootstrap: str,
                 security: dict[str, Any] | None = None, wake: asyncio.Event | None = None,
                 poll_s: float = 1.0):
        super().__init__(wake, poll_s)
        self.settings = settings
        self.engine = engine
        self.bootstrap = bootstrap
        self.security = security
        self.published = 0
        self._producer: AIOKafkaProducer | None = None

    async def run(self, drain: bool = False) -> int:
        """Relay until stopped (or, with ``drain``, until the outbox is empty); how many
        changes were published."""
        try:
            await self.run_batches(drain)
        finally:
            if self._producer is not None:
                await self._producer.stop()
        return self.published

    async def handle_batch(self) -> int:
        try:
            async with self.engine.begin() as conn:
                changes = await take_changes(conn, BATCH, self.settings.changes_with_text)
                if not changes:
                    return 0
                await self._publish([(c.user_id.encode(), c.to_bytes()) for c in changes])
                failpoints.hit("changes.before_drop")
                await drop_changes(conn, [c.change_id for c in changes])
        except (KafkaError, RuntimeError) as exc:  # the rows stay: published at the next poll
            log.warning("change relay: broker unavailable (%s); retrying", exc)
            observe.CHANGE_RELAY_ERRORS.inc()
            return 0
        self.published += len(changes)
        observe.CHANGES_PUBLISHED.inc(len(changes))
        async with self.engine.connect() as conn:
            observe.CHANGES_PENDING.set(await pending_changes(conn))
        return len(changes)

    async def _publish(self, records: list[tuple[bytes, bytes]]) -> None:
        """Send every record and wait until the broker acknowledged each."""
        if self._producer is None:
            await ensure_topics(self.bootstrap, [self.settings.changes_topic],
                                security=self.security)
            producer = make_producer(self.bootstrap, self.security)
            try:
                await producer.start()
            except BaseException:
                await producer.stop()  # nothing left open; started again at the next batch
                raise
            self._producer = producer
        sent = [await self._producer.send(self.settings.changes_topic, value, key=key)
                for key, value in records]
        await asyncio.gather(*sent)
