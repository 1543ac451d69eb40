"""Maintenance stage: the durable tier's upkeep, beside the encode stage of the same model.

- Orphan sweep (every ``orphan_sweep_s``, first when the stage starts): blobs of any model
  whose fact or whose fact's row for that model is gone, or whose KV was evicted
  (``sweep_orphan_blobs``).
- KV budget (``kv_budget_bytes``, ``kv_user_budget_bytes``): every ``kv_evict_interval_s`` the
  KV of the least recently served users (and each user's oldest encodings beyond their budget)
  is evicted, rows first, then blobs (``db/kv_budget.py``); evicted facts are served as text
  and encoded again, before the backlog, once a request wants them.
- Expiry (every ``expire_interval_s``): facts past their ``expires_at`` (never served from
  then on) are retired, rows first, then their blobs of every model (``db/expiry.py``).
- Model migration (``encode_migrate``): while no fact waits for this model's KV, the KV of
  every other model of facts that have this model's goes, a batch at a time (rows, then blobs).

Rows always go before blobs, so a kill in between leaves only blobs no row names, which the
next sweep removes. A job that fails is logged and tried again at its next round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from inferscale.contracts.blob_name import location_model
from inferscale.core import failpoints
from inferscale.core.settings import Settings
from inferscale.db.deletion import blobs_owned
from inferscale.db.encode_queue import count_pending_facts, drop_other_models
from inferscale.db.expiry import retire_expired
from inferscale.db.kv_budget import evict_over_budget, held_kv_bytes
from inferscale.kv.store import KVStore
from inferscale.workers import observe
from inferscale.workers.stage import BatchStage

log = logging.getLogger("inferscale.maintenance")
_EVICT_BATCH = 1000  # facts evicted per transaction


@dataclass
class MaintenanceStats:
    """Counters of one maintenance stage."""

    swept: int = 0  # orphan blobs removed
    evicted: int = 0  # facts whose KV went to keep under the budgets
    migrated: int = 0  # other models' rows of facts that have this model's KV, dropped
    expired: int = 0  # facts retired at their expiry


async def sweep_orphan_blobs(engine: AsyncEngine, store: KVStore) -> int:
    """Remove durable blobs, of any model, whose fact or whose fact's row for that model no
    longer exists (an encode that finished after its user was forgotten, or whose rows were
    rolled back and deleted; KV of a model migrated away from) or whose KV was evicted (an
    eviction that died before deleting them); returns how many."""
    blobs = await asyncio.to_thread(lambda: list(store.fact_blobs()))
    async with engine.connect() as conn:
        owned = await blobs_owned(conn, sorted({fact_id for fact_id, _ in blobs}))
    orphans = [location for fact_id, location in blobs
               if (fact_id, location_model(location)) not in owned]
    return await asyncio.to_thread(store.delete, orphans)


class MaintenanceWorker(BatchStage):
    """Runs each job when it is due; a round that removed something is followed at once by
    the next (so a drain ends when nothing is left to do)."""

    def __init__(self, settings: Settings, engine: AsyncEngine, store: KVStore,
                 wake: asyncio.Event | None = None, poll_s: float = 1.0):
        super().__init__(wake, poll_s)
        self.settings = settings
        self.engine = engine
        self.store = store
        self.stats = MaintenanceStats()
        self._next_sweep = 0.0
        self._next_eviction = 0.0
        self._next_expiry = 0.0

    async def run(self, drain: bool = False) -> MaintenanceStats:
        """Maintain until stopped (or, with ``drain``, until nothing is left to do)."""
        await self.run_batches(drain)
        return self.stats

    async def handle_batch(self) -> int:
        swept, evicted = await self._sweep_when_due(), await self._evict_when_due()
        expired = await self._expire_when_due()
        migrated = await self._migrate() if self.settings.encode_migrate else 0
        return swept + evicted + expired + migrated

    async def _expire_when_due(self) -> int:
        """Retire expired facts (a batch a round) when a round is due: rows, then blobs;
        returns how many."""
        if time.monotonic() < self._next_expiry:
            return 0
        try:
            async with self.engine.begin() as conn:
                ids, locations = await retire_expired(conn, _EVICT_BATCH)
            await asyncio.to_thread(self.store.delete, locations)
        except Exception as exc:  # noqa: BLE001 - maintenance: tried again at the next round
            log.warning("expiry failed: %s", exc)
            ids = []
        if len(ids) < _EVICT_BATCH:  # else the next batch at once
            self._next_expiry = time.monotonic() + self.settings.expire_interval_s
        if ids:
            log.info("retired %d expired facts", len(ids))
            observe.FACTS_EXPIRED.inc(len(ids))
        self.stats.expired += len(ids)
        return len(ids)

    async def _sweep_when_due(self) -> int:
        """Remove orphan blobs when a sweep is due; returns how many."""
        if time.monotonic() < self._next_sweep:
            return 0
        self._next_sweep = time.monotonic() + self.settings.orphan_sweep_s
        try:
            swept = await sweep_orphan_blobs(self.engine, self.store)
        except Exception as exc:  # noqa: BLE001 - maintenance: tried again at the next sweep
            log.warning("orphan sweep failed: %s", exc)
            return 0
        if swept:
            log.warning("removed %d orphan KV blobs (their facts are gone)", swept)
        self.stats.swept += swept
        return swept

    async def _evict_when_due(self) -> int:
        """Bring the durable tier under the KV budgets (when one is set and a round is due):
        rows first, in batches, then each batch's blobs; returns how many facts' KV went."""
        s = self.settings
        if (s.kv_budget_bytes is None and s.kv_user_budget_bytes is None) or (
                time.monotonic() < self._next_eviction):
            return 0
        self._next_eviction = time.monotonic() + s.kv_evict_interval_s
        total = 0
        try:
            while True:
                async with self.engine.begin() as conn:
                    evicted = await evict_over_budget(
                        conn, s.kv_budget_bytes, s.kv_user_budget_bytes, s.kv_evict_grace_s,
                        s.kv_budget_headroom, _EVICT_BATCH)
                if not evicted:
                    break
                total += len(evicted)
                self.stats.evicted += len(evicted)
                failpoints.hit("kv.evict.before_delete")
                await asyncio.to_thread(self.store.delete, [e.location for e in evicted])
                observe.KV_EVICTED_FACTS.inc(len(evicted))
                observe.KV_EVICTED_BYTES.inc(sum(e.nbytes for e in evicted))
                log.info("evicted the KV of %d facts (%.1f MB) to keep under the KV budget",
                         len(evicted), sum(e.nbytes for e in evicted) / 1e6)
                if len(evicted) < _EVICT_BATCH:
                    break
            async with self.engine.connect() as conn:
                observe.KV_HELD_BYTES.set(await held_kv_bytes(conn))
        except Exception as exc:  # noqa: BLE001 - maintenance: tried again at the next round
            log.warning("KV eviction failed: %s", exc)
        return total

    async def _migrate(self) -> int:
        """While no fact waits for this model's KV, drop a batch of other models' KV of facts
        that have this model's: rows, then blobs; returns how many rows went."""
        s, model = self.settings, self.store.fingerprint
        async with self.engine.begin() as conn:
            if await count_pending_facts(conn, model, s.encode_max_attempts,
                                         s.encode_max_crashes):
                return 0  # this model's encodings come first
            dropped = await drop_other_models(conn, model, s.encode_batch_size)
        if held := [location for location in dropped if location]:
            await asyncio.to_thread(self.store.delete, held)
        self.stats.migrated += len(dropped)
        observe.KV_MIGRATED_FACTS.inc(len(dropped))
        return len(dropped)
