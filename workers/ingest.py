"""Turn-ingest stage: Kafka turns -> validated turns in Postgres (the extract stage takes over).

At-least-once: offsets are committed only after the database transaction that stores the batch
has committed; every write is an upsert on a natural key, so redelivery creates no duplicates.
Malformed messages (and values the database refuses) go to the dead-letter topic with the
reason in a header; no record can stop the worker. A member left without partitions watches the
group: records waiting while no member commits for ``group_stall_s`` is reported as a stalled
group (a coordinator that never finishes its rebalance: tansu 0.6.0 after a clean leave during
one), and this worker answers not ready until partitions come back.
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
from inferscale.db.queries import StoredTurn, lock_users, tombstones, upsert_turns
from inferscale.pipeline.kafka import ensure_topics, make_producer
from inferscale.platform import failpoints
from inferscale.platform.retry import is_transient_db_error, retry_transient
from inferscale.platform.settings import Settings
from workers import observe

log = logging.getLogger("inferscale.ingest")

TurnRow = tuple[StoredTurn, datetime]  # a turn and its Kafka record time
OFFSETS_TIMEOUT_S = 10.0  # a look at the group's offsets gives up after this (broker down)
PROBE_FETCH_MS = 2000  # how long that look waits for a record after the committed offsets


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
        self.stalled = False
        self._stop = asyncio.Event()
        self._backlog_checked = 0.0
        self._pending = 0  # the encode backlog at the last back-pressure check
        self._unassigned_since: float | None = None
        self._watched: dict[TopicPartition, int] | None = None  # committed at the last check

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
                await self._watch_group(consumer)
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
            consumer = AIOKafkaConsumer(
                s.turns_topic, bootstrap_servers=self.bootstrap, group_id=s.consumer_group,
                enable_auto_commit=False, auto_offset_reset="earliest",
                session_timeout_ms=s.kafka_session_timeout_ms,
                heartbeat_interval_ms=max(100, s.kafka_session_timeout_ms // 5),
                max_poll_records=s.ingest_batch_size,
            )
            producer = make_producer(self.bootstrap)
            try:
                await ensure_topics(self.bootstrap, [s.turns_topic, s.dead_letter_topic])
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

    async def _watch_group(self, consumer: AIOKafkaConsumer) -> None:
        """Without partitions for ``group_stall_s``, look at the group's committed offsets every
        ``group_stall_s``: records waiting after offsets that did not move since the last look
        mean no member consumes them (unless back-pressure may have paused the members that
        hold them)."""
        now = time.monotonic()
        if consumer.assignment():
            self._unassigned_since, self._watched = None, None
            if self.stalled:
                log.info("partitions assigned again: the group is consuming")
                self._set_stalled(False)
            return
        if self._unassigned_since is None:
            self._unassigned_since = now
        if now - self._unassigned_since < self.settings.group_stall_s:
            return
        self._unassigned_since = now  # the next look after another group_stall_s
        try:
            committed, waiting = await asyncio.wait_for(self._group_offsets(consumer),
                                                        OFFSETS_TIMEOUT_S)
        except (KafkaError, TimeoutError) as exc:
            log.warning("cannot read the group's offsets: %r", exc)
            return
        previous, self._watched = self._watched, committed
        backlogged = self._pending >= self.settings.max_pending_facts // 2
        if waiting and committed == previous and not backlogged:
            if not self.stalled:
                log.error("consumer group %r gives this worker no partitions and commits nothing "
                          "while records wait: a member holding them is stuck, or the "
                          "coordinator never finished a rebalance (restart the broker if it "
                          "lasts)", self.settings.consumer_group)
            self._set_stalled(True)
        elif self.stalled:
            log.info("the group commits again, or nothing waits")
            self._set_stalled(False)

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
        probe = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
        try:
            await probe.start()
            probe.assign(parts)
            for tp, offset in committed.items():
                probe.seek(tp, offset)
            fetched = await probe.getmany(timeout_ms=PROBE_FETCH_MS, max_records=1)
        finally:
            await probe.stop()
        return committed, any(fetched.values())

    def _set_stalled(self, stalled: bool) -> None:
        self.stalled = stalled
        self.ready = not stalled
        observe.GROUP_STALLED.set(1 if stalled else 0)

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
