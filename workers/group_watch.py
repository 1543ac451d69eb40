"""Stalled-group detection: the embedded broker's rebalance wedge, seen from a member.

tansu 0.6.0 (the embedded broker) can leave a consumer group in a rebalance that never ends
after a member leaves cleanly during one: every member then waits for an assignment that never
comes, nothing is consumed and nothing says so. A member without partitions therefore looks at
the group's committed offsets every ``group_stall_s``: records waiting after offsets that did not
move since the last look mean no member consumes them (unless back-pressure may have paused the
members that hold them). Then the group is reported stalled (an error log, the gauge
``inferscale_worker_group_stalled``, /readyz 503) until partitions come back or the offsets
move; a broker restart reloads the group from storage and ends the wedge (docs/operations.md).
Apache Kafka does not wedge this way; there the check only ever finds a stuck member.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from inferscale.core.settings import Settings
from inferscale.pipeline.kafka import kafka_security
from inferscale.workers import observe

log = logging.getLogger("inferscale.ingest")
OFFSETS_TIMEOUT_S = 10.0  # a look at the group's offsets gives up after this (broker down)
PROBE_FETCH_MS = 2000  # how long that look waits for a record after the committed offsets


class GroupWatch:
    """One member's view of whether its consumer group is stalled."""

    def __init__(self, settings: Settings, bootstrap: str) -> None:
        self.settings = settings
        self.bootstrap = bootstrap
        self.is_stalled = False
        self._unassigned_since: float | None = None
        self._watched: dict[TopicPartition, int] | None = None  # committed at the last look

    async def stalled(self, consumer: AIOKafkaConsumer, backlogged: bool) -> bool:
        """Look (at most every ``group_stall_s`` while this member has no partitions) and say
        whether the group is stalled; ``backlogged``: back-pressure may pause members."""
        now = time.monotonic()
        if consumer.assignment():
            self._unassigned_since, self._watched = None, None
            if self.is_stalled:
                log.info("partitions assigned again: the group is consuming")
                self._set(False)
            return self.is_stalled
        if self._unassigned_since is None:
            self._unassigned_since = now
        if now - self._unassigned_since < self.settings.group_stall_s:
            return self.is_stalled
        self._unassigned_since = now  # the next look after another group_stall_s
        try:
            committed, waiting = await asyncio.wait_for(self._group_offsets(consumer),
                                                        OFFSETS_TIMEOUT_S)
        except (KafkaError, TimeoutError) as exc:
            log.warning("cannot read the group's offsets: %r", exc)
            return self.is_stalled
        previous, self._watched = self._watched, committed
        if waiting and committed == previous and not backlogged:
            if not self.is_stalled:
                log.error("consumer group %r gives this worker no partitions and commits nothing "
                          "while records wait: a member holding them is stuck, or the "
                          "coordinator never finished a rebalance (restart the broker if it "
                          "lasts)", self.settings.consumer_group)
            self._set(True)
        elif self.is_stalled:
            log.info("the group commits again, or nothing waits")
            self._set(False)
        return self.is_stalled

    async def _group_offsets(self, consumer: AIOKafkaConsumer
                             ) -> tuple[dict[TopicPartition, int], bool]:
        """The group's committed offset per partition (the log start where none) and whether
        any record waits after them. A groupless probe fetches from those offsets: tansu 0.6.0's
        log end offsets cannot tell (1 for a partition holding 29 records)."""
        topic = self.settings.turns_topic
        parts = [TopicPartition(topic, p)
                 for p in sorted(consumer.partitions_for_topic(topic) or ())]
        starts = await consumer.beginning_offsets(parts)
        committed = {}
        for tp in parts:
            offset = await consumer.committed(tp)
            committed[tp] = starts[tp] if offset is None else offset
        probe = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False,
                                 **kafka_security(self.settings))
        try:
            await probe.start()
            probe.assign(parts)
            for tp, offset in committed.items():
                probe.seek(tp, offset)
            fetched = await probe.getmany(timeout_ms=PROBE_FETCH_MS, max_records=1)
        finally:
            await probe.stop()
        return committed, any(fetched.values())

    def _set(self, stalled: bool) -> None:
        self.is_stalled = stalled
        observe.GROUP_STALLED.set(1 if stalled else 0)
