"""One worker process: the ingest, extract and encode stages side by side."""

from __future__ import annotations

import asyncio
import logging
import signal

from inferscale.db.engine import create_engine
from inferscale.db.queries import count_pending_facts, count_unextracted_turns
from inferscale.embedder import load_embedder
from inferscale.encoder import FactEncoder
from inferscale.extract import Extractor, get_extractor
from inferscale.infra import resolve_kafka_bootstrap
from inferscale.invalidation import publish_invalidation
from inferscale.llm import LocalJsonGenerator, OpenAIJsonGenerator
from inferscale.memory_update import Decide, LLMDecider
from inferscale.settings import Settings
from workers.encode import EncodeWorker, open_encoder_and_store
from workers.extract import ExtractWorker
from workers.ingest import IngestWorker
from workers.observe import HealthServer

log = logging.getLogger("inferscale.worker")


def extraction(settings: Settings, encoder: FactEncoder) -> tuple[Extractor, Decide | None]:
    """The extractor the settings name and, for ``llm``, its update decider: on the endpoint
    ``llm_url`` names, else on the worker's own model (shared with the encoder)."""
    if settings.extractor != "llm":
        return get_extractor(settings.extractor), None
    if settings.llm_url:
        generator = OpenAIJsonGenerator(settings.llm_url, settings.llm_model,
                                        settings.llm_api_key)
    else:
        generator = LocalJsonGenerator.from_loaded(encoder.model, encoder.tokenizer,
                                                   lock=encoder.lock)
    return get_extractor("llm", generator), LLMDecider(generator)


async def _track_ready(health: HealthServer, ingest: IngestWorker,
                       stages: list[asyncio.Task]) -> None:
    """Alive while the extract and encode stages run; ready while the consumer runs too."""
    while True:
        health.alive = not any(stage.done() for stage in stages)
        health.ready = ingest.ready and health.alive
        await asyncio.sleep(0.5)


def _log_death(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the %s stage died; /readyz and /healthz answer 503", task.get_name(),
                  exc_info=task.exception())


async def run_worker(settings: Settings, drain: bool = False) -> dict:
    """Consume, extract and encode until SIGTERM/SIGINT (or drained with ``drain``)."""
    engine = create_engine(settings=settings)
    loop = asyncio.get_running_loop()
    encoder, store = await loop.run_in_executor(None, open_encoder_and_store, settings)
    embedder = await loop.run_in_executor(None, load_embedder, settings)
    extractor, decide = extraction(settings, encoder)
    bootstrap = resolve_kafka_bootstrap(settings)
    to_extract, to_encode = asyncio.Event(), asyncio.Event()

    async def stored(_offsets) -> None:
        to_extract.set()

    async def backlog() -> int:
        async with engine.connect() as conn:
            return await count_pending_facts(conn, settings.encode_max_attempts,
                                             settings.encode_max_crashes
                                             ) + await count_unextracted_turns(conn)

    async def invalidate(user: str, locations: list[str]) -> None:
        await publish_invalidation(bootstrap, settings.invalidation_topic, user, locations)

    ingest = IngestWorker(settings, bootstrap, engine, after_store=stored, backlog=backlog)
    extract = ExtractWorker(settings, engine, embedder, extractor, decide, store=store,
                            invalidate=invalidate, wake=to_extract, extracted=to_encode)
    encode = EncodeWorker(settings, engine, encoder, store, wake=to_encode)
    health = HealthServer()
    if settings.worker_http_port is not None:
        await health.start("0.0.0.0", settings.worker_http_port)
    extracting = asyncio.create_task(extract.run(), name="extract")
    encoding = asyncio.create_task(encode.run(), name="encode")
    for stage in (extracting, encoding):
        stage.add_done_callback(_log_death)
    ready = asyncio.create_task(_track_ready(health, ingest, [extracting, encoding]))

    def stop() -> None:
        ingest.request_stop()
        extract.request_stop()
        encode.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    try:
        await ingest.run(drain=drain)
        if drain:
            extract.request_drain()
            await extracting
            encode.request_drain()
        else:
            extract.request_stop()
            encode.request_stop()
            await extracting
        await encoding
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        for task in (extracting, encoding, ready):  # none outlives the worker (cancelled too)
            task.cancel()
        await asyncio.gather(extracting, encoding, ready, return_exceptions=True)
        await health.stop()
        await engine.dispose()
    return {"ingest": ingest.stats.__dict__, "extract": extract.stats.__dict__,
            "encode": encode.stats.__dict__}
