"""One worker process: the ingest stage and the encode stage side by side."""

from __future__ import annotations

import asyncio
import logging
import signal

from inferscale.db.engine import create_engine
from inferscale.db.queries import count_pending_facts
from inferscale.infra import resolve_kafka_bootstrap
from inferscale.settings import Settings
from workers.encode import EncodeWorker, open_encoder_and_store
from workers.ingest import IngestWorker
from workers.observe import HealthServer

log = logging.getLogger("inferscale.worker")


async def _track_ready(health: HealthServer, ingest: IngestWorker, encoding: asyncio.Task) -> None:
    """Alive while the encode stage runs; ready while the consumer runs too."""
    while True:
        health.alive = not encoding.done()
        health.ready = ingest.ready and health.alive
        await asyncio.sleep(0.5)


def _log_encode_death(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the encode stage died; /readyz and /healthz answer 503",
                  exc_info=task.exception())


async def run_worker(settings: Settings, drain: bool = False) -> dict:
    """Consume turns and encode their facts until SIGTERM/SIGINT (or drained with ``drain``)."""
    engine = create_engine(settings=settings)
    loop = asyncio.get_running_loop()
    encoder, store = await loop.run_in_executor(None, open_encoder_and_store, settings)
    wake = asyncio.Event()

    async def woken(_offsets) -> None:
        wake.set()

    async def backlog() -> int:
        async with engine.connect() as conn:
            return await count_pending_facts(conn, settings.encode_max_attempts,
                                             settings.encode_max_crashes)

    ingest = IngestWorker(settings, resolve_kafka_bootstrap(settings), engine, after_store=woken,
                          backlog=backlog)
    encode = EncodeWorker(settings, engine, encoder, store, wake=wake)
    health = HealthServer()
    if settings.worker_http_port is not None:
        await health.start("0.0.0.0", settings.worker_http_port)
    encoding = asyncio.create_task(encode.run())
    encoding.add_done_callback(_log_encode_death)
    ready = asyncio.create_task(_track_ready(health, ingest, encoding))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: (ingest.request_stop(), encode.request_stop()))
    try:
        await ingest.run(drain=drain)
        if drain:
            encode.request_drain()
        else:
            encode.request_stop()
        await encoding
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        ready.cancel()
        await health.stop()
        await engine.dispose()
    return {"ingest": ingest.stats.__dict__, "encode": encode.stats.__dict__}
