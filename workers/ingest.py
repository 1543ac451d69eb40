"""Turn-ingest stage: Kafka turns -> validated turns in Postgres (the extract stage takes over).

At-least-once: offsets are committed only after the database transaction that stores the batch
has committed; every write is an upsert on a natural key, so redelivery creates no duplicates.
Malformed messages (and values the database refuses) go to the dead-letter topic with the
reason in a header; no record can stop the worker. A member left without partitions watches the
group (``group_watch.py``) and answers not ready while the group is stalled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaError
from sqlalchemy.ext.asyncio import AsyncEngine

from inferscale.contracts.events import InvalidEvent, TurnEvent, parse_record
from inferscale.core import failpoints
from inferscale.core.retry import is_transient_db_error, retry_transient
from inferscale.core.settings import Settings
from inferscale.db.turns import StoredTurn, lock_users, tombstones, upsert_turns
from inferscale.pipeline.kafka import ensure_topics, kafka_security, make_producer
from inferscale.workers import observe
from inferscale.workers.group_watch import GroupWatch

log = logging.getLogger("inferscale.ingest")

TurnRow = tuple[StoredTurn, datetime]  # a turn and its Kafka record time


@dataclass
class IngestStats:
    """Counters of one worker's run."""

    consumed: int = 0
    turns_stored: int = 0
    dead_lettered: int = 0
    batches: int = 0
    db_retries: int = 0
    forgotten: int = 0  # turns of forgotten users, published before the forget: dropped


# SQLSTATE classes of errors a single record causes: data exception (a value Postgres cannot
# store), integrity violation, program limit exceeded (a key too large for its index).
REFUSED_SQLSTATE_CLASSES = ("22", "23", "54")


def refused_by_database(exc: BaseException) -> bool:
    """The database refused a value of the record (not: the database is down or misconfigured)."""
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate[:2] in REFUSED_SQLSTATE_CLASSES


class IngestWorker:
    """One member of the ingest consumer group."""

    def __init__(
        self,
        settings: Settings,
        bootstrap: str,
        engine: AsyncEngine,
        after_store: Callable[[dict[TopicPartition, int]], Awaitable[None]] | None = None,
        backlog: Callable[[], Awaitable[int]] | None = None,
    ):
        self.settings = settings
        self.bootstrap = bootstrap
        self.engine = engine
        self.after_store = after_store
        self.backlog = backlog
        self.stats = IngestStats()
        self.ready = False
        self._stop = asyncio.Event()
        self._backlog_checked = 0.0
        self._pending = 0  # the encode backlog at the last back-pressure check
        self._group = GroupWatch(settings, bootstrap)

    @property
    def stalled(self) -> bool:
        """Whether this member sees its group stalled (see ``group_watch.py``)."""
        return self._group.is_stalled

    def request_stop(self) -> None:
        """Finish the current batch, commit, leave the group."""
        self._stop.set()

    async def run(self, drain: bool = False) -> IngestStats:
        """Consume until stopped (or, with ``drain``, until the topic stays idle)."""
        s = self.settings
        clients = await self._connect()
        if clients is None:
            return self.stats
        consumer, producer = clients
        idle_since = time.monotonic()
        self.ready = True
        try:
            while not self._stop.is_set():
                await self._apply_back_pressure(consumer)
                batch = await consumer.getmany(
                    timeout_ms=s.ingest_poll_ms, max_records=s.ingest_batch_size
                )
                records = [r for part in batch.values() for r in part]
                # Back-pressure may have paused the members holding the waiting records.
                backlogged = self._pending >= s.max_pending_facts // 2
                self.ready = not await self._group.stalled(consumer, backlogged)
                if not records:
                    if drain and consumer.assignment() and not consumer.paused() and (
                        time.monotonic() - idle_since >= s.drain_idle_s
                    ):
                        break
                    continue
                with observe.BATCH_SECONDS.labels("ingest").time():
                    await self._handle(records, producer)
                offsets = {tp: part[-1].offset + 1 for tp, part in batch.items() if part}
                if self.after_store:
                    await self.after_store(offsets)
                failpoints.hit("ingest.before_offset_commit")
                try:
                    await consumer.commit(offsets)
                except KafkaError as exc:
                    # A rebalance or a broker restart: the records are redelivered (to us or
                    # another member) and rewritten idempotently; a later commit supersedes.
                    log.warning("offset commit failed: %s", exc)
                idle_since = time.monotonic()
                await self._report_lag(consumer)
        finally:
            self.ready = False
            await consumer.stop()
            await producer.stop()
        return self.stats

    async def _connect(self) -> tuple[AIOKafkaConsumer, AIOKafkaProducer] | None:
        """Create the topics and start a consumer and a producer, retrying while the broker is
        unreachable (a worker started during a broker restart waits instead of crash-looping).
        None when asked to stop first."""
        s = self.settings

        async def start() -> tuple[AIOKafkaConsumer, AIOKafkaProducer] | None:
            if self._stop.is_set():
                return None
            security = kafka_security(s)
            consumer = AIOKafkaConsumer(
                s.turns_topic, bootstrap_servers=self.bootstrap, group_id=s.consumer_group,
                enable_auto_commit=False, auto_offset_reset="earliest",
                session_timeout_ms=s.kafka_session_timeout_ms,
                heartbeat_interval_ms=max(100, s.kafka_session_timeout_ms // 5),
                max_poll_records=s.ingest_batch_size, **security,
            )
            producer = make_producer(self.bootstrap, security)
            try:
                await ensure_topics(self.bootstrap, [s.turns_topic, s.dead_letter_topic],
                                    security=security)
                await producer.start()
                await consumer.start()
                return consumer, producer
            except KafkaConnectionError:
                await producer.stop()
                await consumer.stop()
                raise

        def unreachable(exc: BaseException, delay: float) -> None:
            log.warning("broker unreachable (%s); retrying in %.1fs", exc, delay)

        return await retry_transient(start, unreachable,
                                     lambda exc: isinstance(exc, KafkaConnectionError),
                                     stop=self._stop)

    async def _apply_back_pressure(self, consumer: AIOKafkaConsumer) -> None:
        """Pause every assigned partition while the encode backlog is over its limit; resume
        below half of it. Nothing is buffered meanwhile: the consumer just stops fetching."""
        if self.backlog is None or time.monotonic() - self._backlog_checked < 1.0:
            return
        self._backlog_checked = time.monotonic()
        try:
            pending = await self.backlog()
        except Exception as exc:
            if not is_transient_db_error(exc):
                raise
            return  # the database is restarting: keep the current state, check again later
        observe.PENDING_FACTS.set(pending)
        self._pending = pending
        limit = self.settings.max_pending_facts
        if pending > limit and consumer.assignment() - consumer.paused():
            consumer.pause(*consumer.assignment())
            log.warning("encode backlog %d > %d facts: pausing consumption", pending, limit)
        elif pending < limit // 2 and consumer.paused():
            consumer.resume(*consumer.paused())
            log.info("encode backlog %d: resuming consumption", pending)
        observe.PAUSED.set(1 if consumer.paused() else 0)

    async def _report_lag(self, consumer: AIOKafkaConsumer) -> None:
        for tp in consumer.assignment():
            highwater = consumer.highwater(tp)
            if highwater is not None:
                observe.LAG.labels(str(tp.partition)).set(
                    max(0, highwater - await consumer.position(tp)))

    async def _handle(self, records: list[ConsumerRecord], producer) -> None:
        valid: dict[tuple[str, str, str], tuple[TurnEvent, ConsumerRecord]] = {}
        dead: list[tuple[ConsumerRecord, str]] = []
        for record in records:
            try:
                event = parse_record(record.key, record.value, self.settings.max_text_bytes)
            except InvalidEvent as exc:
                dead.append((record, exc.reason))
                continue
            except Exception as exc:  # noqa: BLE001 - a parser bug must cost one record only
                log.exception("parser failed on a record", extra=_where(record))
                dead.append((record, f"unparseable: {type(exc).__name__}"))
                continue
            valid.setdefault((event.user_id, event.conversation_id, event.turn_id), (event, record))
        self.stats.consumed += len(records)
        observe.CONSUMED.inc(len(records))
        await self._dead_letter_all(producer, dead)
        if valid:
            await self._dead_letter_all(producer, await self._store(list(valid.values())))
        self.stats.batches += 1

    async def _dead_letter_all(self, producer, dead: list[tuple[ConsumerRecord, str]]) -> None:
        if not dead:
            return
        await asyncio.gather(*(self._dead_letter(producer, r, reason) for r, reason in dead))
        self.stats.dead_lettered += len(dead)
        for _, reason in dead:
            observe.DEAD_LETTERED.labels(_reason_kind(reason)).inc()

    async def _dead_letter(self, producer, record: ConsumerRecord, reason: str) -> None:
        headers = [
            ("reason", reason.encode("utf-8", errors="backslashreplace")[:1024]),
            ("source-topic", record.topic.encode()),
            ("source-partition", str(record.partition).encode()),
            ("source-offset", str(record.offset).encode()),
        ]
        await producer.send_and_wait(
            self.settings.dead_letter_topic, record.value, key=record.key, headers=headers
        )
        log.info("dead-lettered a record", extra={**_where(record), "reason": reason})

    async def _store(self, items: list[tuple[TurnEvent, ConsumerRecord]]
                     ) -> list[tuple[ConsumerRecord, str]]:
        """Store the batch in one transaction. If the database refuses it, store it record by
        record; returns the records the database refused, with their reasons."""
        rows = self._rows(items)
        try:
            await self._write(rows)
            return []
        except Exception as exc:
            log.warning("database refused the batch (%s); storing it record by record",
                        type(exc).__name__)
        refused = []
        for (_, record), row in zip(items, rows, strict=True):
            try:
                await self._write([row])
            except Exception as exc:
                if not refused_by_database(exc):
                    raise
                refused.append((record, f"rejected by database: {_db_error_name(exc)}"))
        return refused

    @staticmethod
    def _rows(items: list[tuple[TurnEvent, ConsumerRecord]]) -> list[TurnRow]:
        """Each event's turn row and when it was published."""
        return [(StoredTurn(user_id=e.user_id, conversation_id=e.conversation_id,
                            turn_id=e.turn_id, speaker=e.speaker, text=e.text, ts=e.timestamp,
                            agent_id=e.agent_id, run_id=e.run_id, metadata=e.metadata or {},
                            source_topic=r.topic, source_partition=r.partition,
                            source_offset=r.offset),
                 datetime.fromtimestamp(r.timestamp / 1000, UTC)) for e, r in items]

    async def _write(self, rows: list[TurnRow]) -> None:
        """One transaction for the rows, retried while the database is unreachable."""
        async def write() -> tuple[int, int]:
            async with self.engine.begin() as conn:
                await lock_users(conn, [turn.user_id for turn, _ in rows], exclusive=False)
                forgotten = await tombstones(conn, [turn.user_id for turn, _ in rows])
                live = [turn for turn, published in rows
                        if turn.user_id not in forgotten or published > forgotten[turn.user_id]]
                new_turns = await upsert_turns(conn, live)
                failpoints.hit("ingest.before_db_commit")
            return new_turns, len(rows) - len(live)

        new_turns, dropped = await retry_transient(write, self._db_retry)
        if dropped:
            log.info("dropped %d turns of forgotten users published before the forget", dropped)
        self.stats.forgotten += dropped
        self.stats.turns_stored += new_turns
        observe.TURNS_STORED.inc(new_turns)

    def _db_retry(self, exc: BaseException, delay: float) -> None:
        self.stats.db_retries += 1
        observe.DB_RETRIES.inc()
        log.warning("database unavailable (%s); retrying in %.1fs", type(exc).__name__, delay)


def _reason_kind(reason: str) -> str:
    """The metric label of a dead-letter reason: its kind (before any colon), short and ASCII
    whatever the reason holds, so that /metrics can always be rendered."""
    return reason.split(":")[0][:48].encode("ascii", "backslashreplace").decode()


def _where(record: ConsumerRecord) -> dict:
    return {"topic": record.topic, "partition": record.partition, "offset": record.offset}


def _db_error_name(exc: BaseException) -> str:
    """The driver's error class (e.g. ``CharacterNotInRepertoireError``) behind SQLAlchemy's."""
    orig = getattr(exc, "orig", None)
    return type(getattr(orig, "__cause__", None) or orig or exc).__name__
