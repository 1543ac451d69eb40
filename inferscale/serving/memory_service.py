"""The memory API's service over this server's vLLM engine (``memory_api.MemoryService``): the
memory runtime, removal of blobs from every tier (durable, this server's workers' memory tiers
now, every other server's through an invalidation), the tiers holding a blob, forgetting an
owner, and the consumer of other servers' invalidations."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from inferscale.core.settings import Settings
from inferscale.pipeline.kafka import kafka_security
from inferscale.serving.access import Access
from inferscale.serving.compose import MemoryRuntime
from inferscale.serving.metrics import FRONTEND_METRICS as M

log = logging.getLogger("inferscale.serving.memory_service")

TIERS_TIMEOUT_S = 5.0


async def _purge(app, locations: list[str]) -> int:
    """Drop blobs from every vLLM worker's memory tiers; returns how many they held. vLLM's
    prefix cache is left alone: its blocks of a forgotten memory are unreachable, as every
    memory prompt's salt names the facts it holds, and fact ids are never reused."""
    purged = sum(await app.state.engine_client.collective_rpc("inferscale_purge",
                                                              args=(locations,)))
    M.purged_blobs.inc(purged)
    return purged


class EngineMemory:
    """The memory service of one vLLM server (one per server process)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.access = Access(settings)
        self._runtime: MemoryRuntime | None = None
        self._lock = asyncio.Lock()
        self._app: Any = None  # vLLM's FastAPI app, known at start-up
        self._invalidations: asyncio.Task | None = None

    def _bootstrap(self) -> str | None:
        from inferscale.core.endpoints import InfraError, resolve_kafka_bootstrap

        try:
            return resolve_kafka_bootstrap(self.settings)
        except InfraError:
            return None

    def bind(self, app) -> None:
        """Serve for vLLM's ``app`` (known at start-up): its engine, and the invalidations
        (forgets made anywhere) consumed for the server's lifetime."""
        self._app = app
        self._invalidations = self._start_invalidation_consumer(app)

    def _start_invalidation_consumer(self, app) -> asyncio.Task | None:
        from inferscale.pipeline.invalidation import consume_invalidations

        bootstrap = self._bootstrap()
        if bootstrap is None:
            log.warning("no Kafka broker configured: forgets made elsewhere are not purged "
                        "from this server's memory tiers")
            return None
        return asyncio.create_task(consume_invalidations(
            bootstrap, self.settings.invalidation_topic, lambda locs: _purge(app, locs),
            security=kafka_security(self.settings)))

    async def runtime(self) -> MemoryRuntime:
        """The memory runtime (model, embedder, database, store), made on first use off the
        event loop."""
        async with self._lock:
            if self._runtime is None:
                loop = asyncio.get_running_loop()
                self._runtime = await loop.run_in_executor(None, MemoryRuntime, self.settings)
        return self._runtime

    async def drop_blobs(self, user_id: str, locations: list[str]) -> int:
        """Remove retired facts' blobs from the durable tier, this server's memory tiers now and
        every other server's through an invalidation (no prefix-cache reset: a plan never names
        a retired fact's blob); returns how many this server's tiers held."""
        from inferscale.pipeline.invalidation import publish_invalidation

        if not locations:
            return 0
        rt = await self.runtime()
        await asyncio.to_thread(rt.store.delete, locations)
        purged = sum(await self._app.state.engine_client.collective_rpc(
            "inferscale_purge", args=(locations,)))
        M.purged_blobs.inc(purged)
        if (bootstrap := self._bootstrap()) is not None:
            await publish_invalidation(bootstrap, self.settings.invalidation_topic, user_id,
                                       locations, kafka_security(self.settings))
        return int(purged)

    async def memory_tiers(self, locations: list[str]) -> list[list[str]] | None:
        """For each blob, the memory tiers of this server's vLLM workers that hold it (None:
        the workers did not answer within ``TIERS_TIMEOUT_S``)."""
        if not locations:
            return []
        try:
            per_worker = await asyncio.wait_for(self._app.state.engine_client.collective_rpc(
                "inferscale_tiers", args=(locations,)), TIERS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a listing must not fail for want of tier status
            log.warning("vLLM workers gave no tier status", exc_info=True)
            return None
        return [sorted({tier for worker in per_worker for tier in worker[i]})
                for i in range(len(locations))]

    async def forget(self, user_id: str) -> dict:
        """Forget a user: rows (with a tombstone), durable blobs, this server's memory tiers
        now, every other server's through an invalidation (``_purge``: no prefix-cache reset)."""
        from inferscale.pipeline.invalidation import publish_invalidation
        from inferscale.serving.forget import forget_user

        rt = await self.runtime()
        forgotten = await forget_user(rt.engine, rt.store, user_id)
        purged = await _purge(self._app, forgotten.locations)
        if (bootstrap := self._bootstrap()) is not None:
            await publish_invalidation(bootstrap, self.settings.invalidation_topic, user_id,
                                       forgotten.locations, kafka_security(self.settings))
        log.info("forgot a user", extra={"facts": forgotten.facts, "blobs": forgotten.blobs})
        return {"user": user_id, "facts_deleted": forgotten.facts,
                "blobs_deleted": forgotten.blobs, "purged_from_memory": purged}
