"""The whole stack on one machine: embedded infra, schema, model, worker and server processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine
from tqdm import tqdm

from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.core.model_prep import resolve_model_path
from inferscale.core.settings import Settings, settings_env
from inferscale.db import migrate
from inferscale.db.encode_queue import (
    count_backfill_facts,
    count_pending_facts,
    register_model,
)
from inferscale.db.engine import resolve_database_url
from inferscale.db.tables import turns
from inferscale.devstack import infra


def prepare(settings: Settings) -> Settings:
    """Start (or reuse) embedded infra where none is configured, migrate, prepare the model."""
    if not (settings.kafka_bootstrap and settings.database_url):
        endpoints = infra.up(settings)
        settings = settings.model_copy(update={
            "kafka_bootstrap": settings.kafka_bootstrap or endpoints.kafka_bootstrap,
            "database_url": settings.database_url or endpoints.database_url})
    migrate.upgrade(resolve_database_url(settings))
    return settings.model_copy(update={"model_path": resolve_model_path(settings),
                                       "kv_dir": settings.kv_path})


def sharing_cores(settings: Settings, processes: int) -> Settings:
    """Settings of a worker that shares this host's cores with ``processes - 1`` other busy
    processes (a vLLM server, other workers): its share of the cores for its torch threads,
    unless set. Processes that each run threads on every core slow each other down many times
    over (``bench freshness`` on 2 cores beside the server: one fact's encode took 1-2 s with
    one worker thread, up to 23 s with two)."""
    if settings.worker_threads is not None:
        return settings
    share = max(1, (os.cpu_count() or 1) // max(processes, 1))
    return settings.model_copy(update={"worker_threads": share})


@contextlib.contextmanager
def worker_process(settings: Settings, log_path: Path, sharing: int = 2
                   ) -> Iterator[subprocess.Popen]:
    """An `inferscale worker` (ingest + encode) in its own process, one of ``sharing`` busy
    processes on this host (by default beside this host's vLLM server); SIGTERM on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "inferscale.cli", "worker"],
                                   env=settings_env(sharing_cores(settings, sharing)),
                                   stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


@contextlib.contextmanager
def server_process(settings: Settings, log_path: Path, extra_args: list[str] | None = None,
                   timeout_s: float = 600) -> Iterator[str]:
    """`inferscale serve` in the background; yields its URL once healthy."""
    from inferscale.serving.serve import start_server, stop_server, wait_ready

    log_path.parent.mkdir(parents=True, exist_ok=True)
    process = start_server(settings, extra_args, log_path=log_path)
    url = f"http://{settings.server_host}:{settings.server_port}"
    try:
        wait_ready(url, process, timeout_s)
        yield url
    finally:
        stop_server(process)


async def wait_encoded(engine: AsyncEngine, user: str, turns_expected: int,
                       settings: Settings | None = None, timeout_s: float = 1800,
                       progress: bool = True) -> float:
    """Wait until ``turns_expected`` turns of ``user`` are stored and extracted and no live
    fact of theirs waits for KV or for backfill (any number of facts per turn); returns the
    seconds waited."""
    s = settings or Settings()
    model = model_fingerprint(resolve_model_path(s))
    async with engine.begin() as conn:  # the workers' model, whether they registered it yet
        await register_model(conn, model)
    started = time.monotonic()
    with tqdm(total=turns_expected, desc="turns extracted", unit="turn",
              disable=not progress) as bar:
        while True:
            async with engine.connect() as conn:
                extracted = (await conn.execute(select(func.count()).where(
                    turns.c.user_id == user, turns.c.extracted_at.is_not(None)))).scalar_one()
                waiting = await count_pending_facts(conn, model, s.encode_max_attempts,
                                                    s.encode_max_crashes, user)
                waiting += await count_backfill_facts(conn, model, s.encode_max_crashes, user)
            bar.update(extracted - bar.n)
            bar.set_postfix(facts_waiting_for_kv=waiting)
            if extracted >= turns_expected and not waiting:
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"{extracted}/{turns_expected} turns extracted, {waiting} "
                                   f"facts waiting for KV after {timeout_s}s")
            await asyncio.sleep(1.0)
