"""Extract stage: stored turns -> facts (with the turns before them as context) -> Postgres.

Turns are leased per user (``extract_lease_s``) so a user's new facts are decided in turn order
by one worker at a time; a batch's facts, the facts they retire and the turns' ``extracted_at``
commit in one transaction, so a turn is extracted once whatever is redelivered or restarted (a
worker that dies mid-batch stored nothing, and its lease runs out). Retired facts' blobs leave
the durable tier here and every server's memory tiers through the invalidation topic, the path
``forget`` uses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import numpy as np
from sqlalchemy.ext.asyncio import AsyncEngine

from inferscale.core import failpoints
from inferscale.core.retry import retry_transient
from inferscale.core.settings import Settings
from inferscale.db.extract_queue import (
    ClaimedTurn,
    claim_unextracted_turns,
    nearest_live_facts,
    record_extraction,
)
from inferscale.db.turns import NewFact
from inferscale.kv.store import KVStore
from inferscale.pipeline.embedder import Embedder
from inferscale.pipeline.extraction import Draft, Extractor, TurnExtractor, TurnInContext
from inferscale.pipeline.updates import Decide, NewDraft, UpdatePlan, plan_updates
from inferscale.workers import observe
from inferscale.workers.stage import BatchStage

log = logging.getLogger("inferscale.pipeline.extraction")

Invalidate = Callable[[str, list[str]], Awaitable[None]]  # (user, blob locations)


@dataclass
class ExtractStats:
    """Counters of one extract stage."""

    turns: int = 0
    facts: int = 0
    retired: int = 0
    batches: int = 0


class ExtractWorker(BatchStage):
    """Polls for unextracted turns (woken early by ingest) and extracts them in batches."""

    def __init__(self, settings: Settings, engine: AsyncEngine, embedder: Embedder,
                 extractor: Extractor, decide: Decide | None = None, store: KVStore | None = None,
                 invalidate: Invalidate | None = None, wake: asyncio.Event | None = None,
                 extracted: asyncio.Event | None = None, poll_s: float = 1.0):
        super().__init__(wake, poll_s)
        self.settings = settings
        self.engine = engine
        self.embedder = embedder
        self.extractor = extractor
        self.decide = decide  # None: every new fact is an ADD
        self.store = store
        self.invalidate = invalidate
        self.extracted = extracted  # set after facts are stored (wakes the encode stage)
        self.stats = ExtractStats()

    async def run(self, drain: bool = False) -> ExtractStats:
        """Extract until stopped (or, with ``drain``, until no turn is left)."""
        await self.run_batches(drain)
        return self.stats

    async def handle_batch(self) -> int:
        return await self.extract_pending()

    async def extract_pending(self) -> int:
        """Extract one batch of leased turns; returns how many turns it handled."""
        s = self.settings
        async with self.engine.begin() as conn:
            claimed = await claim_unextracted_turns(conn, s.extract_batch_size,
                                                    s.extract_lease_s, s.extract_context_turns)
        if not claimed:
            return 0
        loop = asyncio.get_running_loop()
        with observe.BATCH_SECONDS.labels("extract").time():
            drafts = await loop.run_in_executor(None, self._extract, claimed)
            flat = [(t, ordinal, d) for t, ds in zip(claimed, drafts, strict=True)
                    for ordinal, d in enumerate(ds)]
            vectors = await loop.run_in_executor(
                None, self.embedder.encode, [d.text for _, _, d in flat])
            plan = await self._plan([f if f[0].claim <= s.extract_max_crashes else None
                                     for f in flat], vectors)
            new_facts = [_new_fact(*flat[i], vectors[i]) for i in plan.keep]
            position = {i: n for n, i in enumerate(plan.keep)}  # batch index -> new_facts index
            retire = [replace(r, by=position[r.by]) if r.by is not None else r
                      for r in plan.retire]

            async def record() -> tuple[int, list[tuple[str, list[str]]]]:
                async with self.engine.begin() as conn:
                    stored = await record_extraction(conn, claimed, new_facts, retire)
                    failpoints.hit("extract.before_db_commit")
                return stored

            stored, retired = await retry_transient(record, self._db_retry)
        await self._drop_blobs(retired)
        self.stats.batches += 1
        self.stats.turns += len(claimed)
        self.stats.facts += stored
        self.stats.retired += len(retired)
        observe.TURNS_EXTRACTED.inc(len(claimed))
        observe.FACTS_STORED.inc(stored)
        observe.FACTS_RETIRED.inc(len(retired))
        if self.extracted is not None and stored:
            self.extracted.set()
        return len(claimed)

    def _extract(self, claimed: list[ClaimedTurn]) -> list[list[Draft]]:
        """Blocking: the extractor's drafts per turn. Turns claimed more than
        ``extract_max_crashes`` times (their batch kept killing workers, or outran its lease)
        are kept whole, without the model: no turn can crash-loop the stage."""
        failpoints.hit("extract.before_model", "\n".join(t.text for t in claimed))
        limit = self.settings.extract_max_crashes
        suspect = [t.claim > limit for t in claimed]
        if any(suspect):
            log.error("%d turns were claimed more than %d times: kept whole, without the model",
                      sum(suspect), limit)
        modelled = iter(self.extractor.extract(
            [_in_context(t) for t, bad in zip(claimed, suspect, strict=True) if not bad]))
        whole = iter(TurnExtractor().extract(
            [_in_context(t) for t, bad in zip(claimed, suspect, strict=True) if bad]))
        return [next(whole) if bad else next(modelled) for bad in suspect]

    async def _plan(self, flat: list[tuple[ClaimedTurn, int, Draft] | None],
                    vectors: np.ndarray) -> UpdatePlan:
        """ADD everything, or decide each new fact (None: add it unasked) against its user's
        nearest stored facts."""
        to_ask = {i: f for i, f in enumerate(flat) if f is not None}
        asked = list(to_ask)
        if self.decide is None or not asked:
            return UpdatePlan(keep=list(range(len(flat))))
        n = self.settings.update_candidates
        stored: list = [None] * len(asked)
        async with self.engine.connect() as conn:
            for user, scope in dict.fromkeys((to_ask[i][0].user_id, to_ask[i][0].scope)
                                             for i in asked):
                mine = [j for j, i in enumerate(asked)
                        if (to_ask[i][0].user_id, to_ask[i][0].scope) == (user, scope)]
                near = await nearest_live_facts(conn, user, scope,
                                                [vectors[asked[j]] for j in mine], n)
                for j, facts in zip(mine, near, strict=True):
                    stored[j] = facts
        drafts = [NewDraft(to_ask[i][0].user_id, to_ask[i][2].text,
                           np.asarray(vectors[i], dtype=np.float32), to_ask[i][0].scope)
                  for i in asked]
        loop = asyncio.get_running_loop()
        plan = await loop.run_in_executor(None, plan_updates, drafts, stored, self.decide, n)
        unasked = [i for i, f in enumerate(flat) if f is None]
        return UpdatePlan(keep=sorted([asked[j] for j in plan.keep] + unasked),
                          retire=[replace(r, by=asked[r.by]) if r.by is not None else r
                                  for r in plan.retire])

    async def _drop_blobs(self, retired: list[tuple[str, list[str]]]) -> None:
        """Remove retired facts' blobs from the durable tier and every server's memory."""
        by_user: dict[str, list[str]] = {}
        for user, locations in retired:
            if locations:
                by_user.setdefault(user, []).extend(locations)
        for user, locations in by_user.items():
            if self.store is not None:
                await asyncio.to_thread(self.store.delete, locations)
            if self.invalidate is not None:
                await self.invalidate(user, locations)


def _in_context(turn: ClaimedTurn) -> TurnInContext:
    return TurnInContext(turn.speaker, turn.text, turn.ts, turn.context)


def _new_fact(turn: ClaimedTurn, ordinal: int, draft: Draft, vector) -> NewFact:
    return NewFact(user_id=turn.user_id, conversation_id=turn.conversation_id,
                   turn_ids=(turn.turn_id,), ordinal=ordinal, extractor=draft.extractor,
                   text=draft.text, ts=turn.ts, embedding=vector.tolist(),
                   agent_id=turn.agent_id, run_id=turn.run_id, metadata=turn.metadata)
