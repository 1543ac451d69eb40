"""One worker process: the ingest stage and the encode stage side by side."""

from __future__ import annotations

import asyncio
import signal

from inferscale.db.engine import create_engine
from inferscale.infra import resolve_kafka_bootstrap
from inferscale.settings import Settings
from workers.encode import EncodeWorker, open_encoder_and_store
from workers.ingest import IngestWorker


async def run_worker(settings: Settings, drain: bool = False) -> dict:
    """Consume turns and encode their facts until SIGTERM/SIGINT (or drained with ``drain``)."""
    engine = create_engine(settings=settings)
    loop = asyncio.get_running_loop()
    encoder, store = await loop.run_in_executor(None, open_encoder_and_store, settings)
    wake = asyncio.Event()

    async def woken(_offsets) -> None:
        wake.set()

    ingest = IngestWorker(settings, resolve_kafka_bootstrap(settings), engine, after_store=woken)
    encode = EncodeWorker(settings, engine, encoder, store, wake=wake)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: (ingest.request_stop(), encode.request_stop()))
    try:
        encoding = asyncio.create_task(encode.run())
        await ingest.run(drain=drain)
        if drain:
            encode.request_drain()
        else:
            encode.request_stop()
        await encoding
    finally:
        await engine.dispose()
    return {"ingest": ingest.stats.__dict__, "encode": encode.stats.__dict__}
