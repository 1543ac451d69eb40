"""One worker process: the ingest, extract, encode, maintenance and change relay stages side by
side."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
from typing import Any

from inferscale.core.endpoints import resolve_kafka_bootstrap
from inferscale.core.settings import Settings
from inferscale.db.encode_queue import count_pending_facts
from inferscale.db.engine import create_engine
from inferscale.db.extract_queue import count_unextracted_turns
from inferscale.kv.encoder import FactEncoder
from inferscale.pipeline.embedder import load_embedder
from inferscale.pipeline.extraction import Extractor, get_extractor
from inferscale.pipeline.generators import JsonGenerator, LocalJsonGenerator, OpenAIJsonGenerator
from inferscale.pipeline.invalidation import publish_invalidation
from inferscale.pipeline.kafka import kafka_security
from inferscale.pipeline.updates import Decide, LLMDecider
from inferscale.workers.change_relay import ChangeRelay
from inferscale.workers.encode import EncodeWorker, open_encoder_and_store
from inferscale.workers.extract import ExtractWorker
from inferscale.workers.ingest import IngestWorker
from inferscale.workers.maintenance import MaintenanceWorker
from inferscale.workers.observe import HealthServer

log = logging.getLogger("inferscale.worker")


def extraction(settings: Settings, encoder: FactEncoder) -> tuple[Extractor, Decide | None]:
    """The extractor the settings name and, for ``llm``, its update decider: on the endpoint
    ``llm_url`` names, else on the worker's own model (shared with the encoder)."""
    if settings.extractor != "llm":
        return get_extractor(settings.extractor), None
    generator: JsonGenerator
    if settings.llm_url:
        generator = OpenAIJsonGenerator(settings.llm_url, settings.llm_model,
                                        settings.llm_api_key)
    else:
        generator = LocalJsonGenerator.from_loaded(encoder.model, encoder.tokenizer,
                                                   lock=encoder.lock)
    return get_extractor("llm", generator), LLMDecider(generator)


async def _track_ready(health: HealthServer, ingest: IngestWorker,
                       stages: list[asyncio.Task]) -> None:
    """Alive while the extract, encode and maintenance stages run; ready while the consumer
    runs too."""
    while True:
        dead = [stage for stage in stages if stage.done()]
        health.alive = not dead
        health.ready = ingest.ready and health.alive
        health.problem = "; ".join(f"{stage.get_name()} stage died: {_death_cause(stage)}"
                                   for stage in dead)
        await asyncio.sleep(0.5)


def _death_cause(task: asyncio.Task) -> str:
    """The first line of what ended a stage's task."""
    if task.cancelled() or task.exception() is None:
        return "ended"
    exc = task.exception()
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _log_death(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the %s stage died; /readyz and /healthz answer 503", task.get_name(),
                  exc_info=task.exception())


def _suspended_at(task: asyncio.Task) -> str:
    """Where a task waits: its chain of awaited coroutines, outermost first."""
    where: list[str] = []
    coro: Any = task.get_coro()  # follows cr_await: coroutines, generators, None
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        where.append(f"{coro.cr_frame.f_code.co_qualname}:{coro.cr_frame.f_lineno}")
        coro = coro.cr_await
    return f"{task.get_name()}: {' > '.join(where)}"


def _give_up(timeout_s: float) -> None:
    """The stop took too long: say where each task is stuck and exit without finishing."""
    stuck = [_suspended_at(t) for t in asyncio.all_tasks() if not t.done()]
    log.error("did not stop within %.0fs; exiting without finishing (the work not yet committed "
              "is redone by another worker); stuck: %s", timeout_s, "; ".join(stuck))
    logging.shutdown()
    os._exit(1)


class _Shutdown:
    """SIGTERM/SIGINT: stop the stages once, with a deadline. The deadline is armed in the
    signal handler itself, so it holds even when the event loop is blocked: after
    ``timeout_s`` the loop logs the stuck tasks and exits; a few seconds later, if the loop
    could not, faulthandler dumps every thread's stack and exits."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float, stop) -> None:
        self.loop, self.timeout_s, self.stop = loop, timeout_s, stop
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, _frame) -> None:
        if self.requested:
            return
        self.requested = True
        faulthandler.dump_traceback_later(self.timeout_s + 5, exit=True)
        self.loop.call_soon_threadsafe(self._begin, signal.Signals(signum).name)

    def _begin(self, name: str) -> None:
        log.info("%s: finishing the current batches (at most %.0fs)", name, self.timeout_s)
        self.loop.call_later(self.timeout_s, _give_up, self.timeout_s)
        self.stop()

    def restore(self) -> None:
        """Put the previous handlers back; an armed deadline stays until the process exits."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


async def run_worker(settings: Settings, drain: bool = False) -> dict:
    """Consume, extract, encode and maintain until SIGTERM/SIGINT (or drained with ``drain``:
    maintenance drains last, once nothing waits for encoding)."""
    if settings.worker_threads is not None:
        import torch

        torch.set_num_threads(settings.worker_threads)
        log.info("torch threads: %d", torch.get_num_threads())
    engine = create_engine(settings=settings)
    loop = asyncio.get_running_loop()
    encoder, store = await loop.run_in_executor(None, open_encoder_and_store, settings)
    embedder = await loop.run_in_executor(None, load_embedder, settings)
    extractor, decide = extraction(settings, encoder)
    bootstrap, security = resolve_kafka_bootstrap(settings), kafka_security(settings)
    to_extract, to_encode = asyncio.Event(), asyncio.Event()

    async def stored(_offsets) -> None:
        to_extract.set()

    async def backlog() -> int:
        async with engine.connect() as conn:
            return await count_pending_facts(conn, store.fingerprint, settings.encode_max_attempts,
                                             settings.encode_max_crashes
                                             ) + await count_unextracted_turns(conn)

    async def invalidate(user: str, locations: list[str]) -> None:
        await publish_invalidation(bootstrap, settings.invalidation_topic, user, locations,
                                   security=security)

    ingest = IngestWorker(settings, bootstrap, engine, after_store=stored, backlog=backlog)
    extract = ExtractWorker(settings, engine, embedder, extractor, decide, store=store,
                            invalidate=invalidate, wake=to_extract, extracted=to_encode)
    encode = EncodeWorker(settings, engine, encoder, store, wake=to_encode)
    maintain = MaintenanceWorker(settings, engine, store)
    relay = ChangeRelay(settings, engine, bootstrap, security)
    health = HealthServer()
    if settings.worker_http_port is not None:
        await health.start(settings.worker_http_host, settings.worker_http_port)
    extracting = asyncio.create_task(extract.run(), name="extract")
    encoding = asyncio.create_task(encode.run(), name="encode")
    maintaining = asyncio.create_task(maintain.run(), name="maintenance")
    relaying = asyncio.create_task(relay.run(), name="changes")
    stages = [extracting, encoding, maintaining, relaying]
    for stage in stages:
        stage.add_done_callback(_log_death)
    ready = asyncio.create_task(_track_ready(health, ingest, stages))

    def stop() -> None:
        for worker in (ingest, extract, encode, maintain, relay):
            worker.request_stop()

    shutdown = _Shutdown(loop, settings.worker_shutdown_s, stop)
    try:
        await ingest.run(drain=drain)
        if drain:
            extract.request_drain()
            await extracting
            encode.request_drain()
            await encoding
            maintain.request_drain()
            await maintaining
            relay.request_drain()
        else:
            for worker in (extract, encode, maintain, relay):
                worker.request_stop()
        await asyncio.gather(*stages)
    finally:
        shutdown.restore()
        for task in (*stages, ready):  # none outlives the worker (cancelled too)
            task.cancel()
        await asyncio.gather(*stages, ready, return_exceptions=True)
        await health.stop()
        await engine.dispose()
    return {"ingest": ingest.stats.__dict__, "extract": extract.stats.__dict__,
            "encode": encode.stats.__dict__, "maintenance": maintain.stats.__dict__,
            "changes": {"published": relay.published}}
