"""Encode worker stage: facts without KV -> Context-Window Encoding -> durable KV + Postgres.

Facts are claimed with a lease (``encode_lease_s``, committed before encoding) so several
workers never encode the same fact at once; a batch that fails is retried fact by fact so one
bad fact cannot block others, and every failure is recorded with its reason and retried after
an exponential backoff (a bounded number of times, except durable-tier errors, which are
retried until they clear). A fact whose encoding kills its worker (OOM, segfault) is claimed
alone after the first death and quarantined after ``encode_max_crashes`` deaths.

Early-fact backfill (``encode_backfill``, neighbours context): when nothing is pending, facts
marked because their user now has 3 x ``window`` facts are encoded again after a full context.
Their blob is replaced in place (same name, new checksum): servers page the new one in, since a
memory tier serves a blob only under the checksum the plan expects.

Lead blobs (``lead_share``): a fact gets a second blob, encoded after the preamble alone, where
its owner's memory is small or its id hashes into the share; servers put one such fact first.

Several models (``fact_kv``): the stage registers its model in its first batch, so every live
fact (and every fact inserted later) waits for this model's KV too, the facts of before after
the fresh ones; other models' KV stays for their servers. The durable tier's upkeep (orphan
sweep, KV budget, model migration) is the maintenance stage's (``workers/maintenance.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from inferscale.contracts.blob_name import fact_blob, holds_lead, lead_blob
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.core import failpoints
from inferscale.core.model_prep import resolve_model_path
from inferscale.core.retry import retry_transient
from inferscale.core.settings import Settings
from inferscale.db.encode_queue import (
    STORAGE_FAILURE,
    EncodedFact,
    PendingFact,
    Recorded,
    claim_backfill_facts,
    claim_pending_facts,
    mark_backfill_due,
    quarantine_crashed_facts,
    record_encode_failure,
    record_encoded,
    register_model,
)
from inferscale.kv.encoder import FactEncoder, ensure_preamble, load_encoder
from inferscale.kv.store import KVStore
from inferscale.workers import observe
from inferscale.workers.model_thread import ModelCallStuck, ModelThread
from inferscale.workers.stage import BatchStage

log = logging.getLogger("inferscale.encode")


def failure_reason(exc: BaseException) -> str:
    """``storage: ...`` for durable-tier errors (disk full, permission denied: retried until
    they clear), ``encode: ...`` for the rest (retried ``encode_max_attempts`` times)."""
    kind = STORAGE_FAILURE if isinstance(exc, OSError) else "encode"
    return f"{kind}: {type(exc).__name__}: {exc}"


def open_encoder_and_store(settings: Settings) -> tuple[FactEncoder, KVStore]:
    """Load the model named by the settings and the KV store keyed by its fingerprint."""
    encoder = load_encoder(settings)
    store = KVStore.from_settings(settings, model_fingerprint(resolve_model_path(settings)),
                                  host_bytes=settings.host_cache_bytes)
    return encoder, store


@dataclass
class EncodeStats:
    """Counters of one encode stage."""

    encoded: int = 0
    reencoded: int = 0  # of those, facts encoded again after a wider context (backfill)
    restored: int = 0  # of those, facts whose KV had been evicted, wanted back by a request
    failed: int = 0
    batches: int = 0


class EncodeWorker(BatchStage):
    """Polls for unencoded facts (woken early by the extract stage) and encodes them in
    batches."""

    def __init__(self, settings: Settings, engine: AsyncEngine, encoder: FactEncoder,
                 store: KVStore, wake: asyncio.Event | None = None, poll_s: float = 1.0):
        super().__init__(wake, poll_s)
        self.settings = settings
        self.engine = engine
        self.encoder = encoder
        self.store = store
        # Forward passes run here, each watched: past encode_stuck_s the stage dies (see run).
        self.model_thread = ModelThread("encode")
        self.stats = EncodeStats()
        self._preamble_ready = False
        self._registered = False

    async def run(self, drain: bool = False) -> EncodeStats:
        """Encode until stopped (or, with ``drain``, until nothing is pending)."""
        swept = await asyncio.get_running_loop().run_in_executor(None, self.store.sweep_temp)
        if swept:
            log.warning("removed %d half-written KV temp files of dead writers", swept)
        try:
            await self.run_batches(drain)
        finally:
            self.model_thread.close()
        return self.stats

    async def handle_batch(self) -> int:
        return await self.encode_pending()

    async def before_batch(self) -> None:
        """Store the preamble's KV once (retried each round while the durable tier fails)."""
        if self._preamble_ready:
            return
        try:
            await self._model_call("preamble encode",
                                   lambda: ensure_preamble(self.encoder, self.store))
            self._preamble_ready = True
        except OSError as exc:
            log.warning("cannot store the preamble KV: %s", exc)

    async def after_batch(self, busy_s: float) -> None:
        """Idle long enough after a batch that the busy share stays at the duty cycle."""
        duty = self.settings.encode_duty_cycle
        if duty < 1.0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), busy_s * (1 - duty) / duty)

    @property
    def _backfill(self) -> bool:
        s = self.settings
        return s.encode_backfill and s.encode_context == "neighbours" and s.window > 0

    async def encode_pending(self) -> int:
        """Register the model (the first time), then encode one batch of facts waiting for its
        KV (when none are, of facts due for backfill); returns how many facts it handled."""
        s = self.settings
        model = self.store.fingerprint
        if not self._registered:  # once (in the batch: retried while the database restarts)
            async with self.engine.begin() as conn:
                enrolled = await register_model(conn, model)
            self._registered = True
            if enrolled:
                log.info("registered model %s: %d facts wait for its KV", model[:16], enrolled)
        async with self.engine.begin() as conn:
            quarantined = await quarantine_crashed_facts(conn, model, s.encode_max_crashes)
            pending = await claim_pending_facts(conn, model, s.encode_batch_size, s.window,
                                                s.encode_max_attempts, s.encode_lease_s,
                                                s.encode_max_crashes, s.encode_context,
                                                self._backfill)
            if not pending and self._backfill:
                pending = await claim_backfill_facts(conn, model, s.encode_batch_size, s.window,
                                                     s.encode_lease_s, s.encode_max_crashes)
        if quarantined:
            log.error("quarantined facts %s: workers died %d times while encoding each (they "
                      "are served as text)", quarantined, s.encode_max_crashes)
        loop = asyncio.get_running_loop()
        if not pending:
            return 0
        with observe.BATCH_SECONDS.labels("encode").time():
            done, failures = await self._model_call(
                f"encode of facts {[fact.id for fact in pending]}",
                lambda: self._encode_and_store(pending))
        if done:
            log.info("wrote KV for %d facts", len(done),
                     extra={"fact_ids": [row.id for row in done],
                            "reencoded_ids": [row.id for row in done if row.reencode]})
        users = sorted({fact.user_id for fact in pending})
        outcome = await retry_transient(lambda: self._record(done, failures, users),
                                        self._db_retry)
        gone = outcome.gone
        if gone:  # their user was forgotten meanwhile: leave no KV of theirs behind
            await loop.run_in_executor(None, self.store.delete, [r.location for r in gone])
        self.stats.batches += 1
        self.stats.encoded += len(done) - len(gone)
        reencoded = sum(r.reencode for r in done) - sum(r.reencode for r in gone)
        self.stats.reencoded += reencoded
        observe.FACTS_REENCODED.inc(reencoded)
        restored = sum(r.restored for r in done) - sum(r.restored for r in gone)
        self.stats.restored += restored
        observe.KV_RESTORED_FACTS.inc(restored)
        self.stats.failed += len(failures)
        observe.FACTS_ENCODED.inc(len(done) - len(gone))
        observe.ENCODE_FAILURES.inc(len(failures))
        if failures:
            log.warning("encode failed for %d facts: %s", len(failures), failures[0][1])
        return len(pending)

    async def _model_call(self, name: str, call):
        """``call`` on the model thread; past ``encode_stuck_s`` the stage dies with
        ``ModelCallStuck`` (logged with the thread's stack, counted, /readyz and /healthz 503)
        and leaves its claims to run out: another worker encodes those facts."""
        try:
            return await self.model_thread.run(name, call, self.settings.encode_stuck_s)
        except ModelCallStuck:
            observe.MODEL_CALLS_STUCK.labels("encode").inc()
            raise

    async def _record(self, done: list[EncodedFact], failures: list[tuple[PendingFact, str]],
                      users: list[str]) -> Recorded:
        """Commit the batch's outcomes (ending its leases) and mark the batch's users' early
        facts for backfill where due."""
        s = self.settings
        model = self.store.fingerprint
        async with self.engine.begin() as conn:
            recorded = await record_encoded(conn, done)
            for fact, error in failures:
                await record_encode_failure(conn, model, fact, error, s.encode_retry_base_s,
                                            s.encode_retry_max_s)
            if self._backfill:
                await mark_backfill_due(conn, model, users, s.window)
            failpoints.hit("encode.before_db_commit")
        return recorded

    def _encode_and_store(self, pending: list[PendingFact]
                          ) -> tuple[list[EncodedFact], list[tuple[PendingFact, str]]]:
        """Blocking: one batched forward pass, durable writes; isolates failures per fact."""
        try:
            return self._encode_batch(pending)
        except Exception as exc:  # noqa: BLE001 - retried fact by fact below to isolate it
            if len(pending) == 1:
                return [], [(pending[0], failure_reason(exc))]
        done, failures = [], []
        for fact in pending:
            try:
                stored, failed = self._encode_batch([fact])
            except Exception as exc:  # noqa: BLE001 - recorded and retried later
                stored, failed = [], [(fact, failure_reason(exc))]
            done += stored
            failures += failed
        return done, failures

    def _wants_lead(self, fact: PendingFact) -> bool:
        """Whether ``fact`` gets a lead blob: where it has context (without, its own blob is
        exact first), if its owner's memory is small (fewer than ``window`` facts before it, or
        a backfill of one of the first: a re-encoding keeps its lead), else for ``lead_share``
        of the facts."""
        s = self.settings
        return s.lead_encoding and bool(fact.context) and (
            fact.reencode or len(fact.context) < s.window or holds_lead(fact.id, s.lead_share))

    def _encode_batch(self, pending: list[PendingFact]
                      ) -> tuple[list[EncodedFact], list[tuple[PendingFact, str]]]:
        """One forward pass for the batch (and one for its lead encodings: the facts after the
        preamble alone, where ``_wants_lead``), then the durable writes per fact; a write
        that fails (disk full, ...) fails only its fact, and the batch is not encoded again."""
        items = [self.encoder.fact_item(f.text, f.context) for f in pending]
        leading = [f for f in pending if self._wants_lead(f)]
        failpoints.hit("encode.before_forward", "\n".join(f.text for f in pending))
        spans = self.encoder.encode(items)
        leads = dict(zip((f.id for f in leading), self.encoder.encode(
            [self.encoder.fact_item(f.text, []) for f in leading]), strict=True))
        rows, failures = [], []
        for fact, span in zip(pending, spans, strict=True):
            try:
                lead = leads.get(fact.id)
                if lead is None and fact.claim > 1 and not fact.reencode:
                    # a claimer that died after writing a lead blob this encoding does not
                    # want (the memory grew meanwhile) left one that no row names
                    self.store.delete([self.store.location_for(lead_blob(fact.id))])
                stored_lead = None if lead is None else self.store.put(
                    lead_blob(fact.id), lead.k, lead.v, lead.token_ids, window=0,
                    kv_format=self.settings.lead_kv_format or self.settings.kv_format)
                stored = self.store.put(fact_blob(fact.id), span.k, span.v, span.token_ids,
                                        window=self.settings.window,
                                        kv_format=self.settings.kv_format)
            except OSError as exc:
                failures.append((fact, failure_reason(exc)))
                continue
            rows.append(EncodedFact(
                id=fact.id, claim=fact.claim, token_ids=span.token_ids,
                window=self.settings.window, context_facts=len(fact.context),
                reencode=fact.reencode, restored=fact.restored,
                fingerprint=self.store.fingerprint,
                location=stored.location, checksum=stored.checksum,
                nbytes=stored.nbytes + (stored_lead.nbytes if stored_lead else 0),
                lead_checksum=stored_lead.checksum if stored_lead else None))
        return rows, failures
