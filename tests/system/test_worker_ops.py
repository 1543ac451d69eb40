"""Worker operations on the real broker and Postgres: back-pressure, health and metrics."""

import asyncio
import contextlib
import signal
import socket
import threading
import time
import uuid

import httpx
import pytest
from pydantic import ValidationError

from helpers import sample_turns, turn
from inferscale.core.settings import Settings
from inferscale.db.turns import count_user_rows
from inferscale.devstack.stack import worker_process
from inferscale.pipeline.kafka import ensure_topics, publish_turns
from inferscale.workers import run
from inferscale.workers.ingest import IngestWorker
from inferscale.workers.observe import HealthServer


async def test_back_pressure_pauses_then_resumes(settings, engine, embedder):
    turns = sample_turns()
    user = turns[0].user_id
    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic])
    await publish_turns(settings.kafka_bootstrap, settings.turns_topic, turns, progress=False)
    backlog = {"pending": 10**6}

    async def pending() -> int:
        return backlog["pending"]

    worker = IngestWorker(settings.model_copy(update={"max_pending_facts": 100}),
                          settings.kafka_bootstrap, engine, backlog=pending)
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(6)  # group join (~1 s with 2 s sessions) + several polls while paused
    async with engine.connect() as conn:
        assert await count_user_rows(conn, user) == (0, 0)
    assert worker.stats.consumed == 0
    backlog["pending"] = 0
    for _ in range(60):
        async with engine.connect() as conn:
            if await count_user_rows(conn, user) == (len(turns), 0):
                break
        await asyncio.sleep(0.5)
    worker.request_stop()
    await task
    assert worker.stats.turns_stored == len(turns)


async def test_health_and_metrics_endpoints():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    health = HealthServer()
    await health.start("127.0.0.1", port)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/readyz")).status_code == 503
            health.ready = True
            assert (await client.get("/readyz")).status_code == 200
            metrics = (await client.get("/metrics")).text
            assert "inferscale_worker_consumed_total" in metrics
            assert "inferscale_worker_lag" in metrics or "inferscale_worker_paused" in metrics
        for garbage in (b"\x00\xff" * 600 + b"\r\n\r\n", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n",
                        b"POST /healthz HTTP/1.1\r\nContent-Length: 99999999\r\n\r\nx", b""):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                raw.sendall(garbage)
                raw.shutdown(socket.SHUT_WR)
                with contextlib.suppress(OSError):
                    raw.recv(4096)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/healthz")).status_code == 200  # still serving
    finally:
        await health.stop()


class _DyingStore:
    """A KV store whose first use fails once the test lets it: the encode stage dies."""

    fingerprint = "d" * 64

    def __init__(self) -> None:
        self.release = threading.Event()

    def sweep_temp(self) -> int:
        self.release.wait(60)
        raise RuntimeError("durable tier misconfigured")


async def test_readyz_fails_when_the_encode_stage_dies(settings, monkeypatch, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = _DyingStore()
    monkeypatch.setattr(run, "open_encoder_and_store", lambda _settings: (object(), store))
    cfg = settings.model_copy(update={"worker_http_port": port})
    worker = asyncio.create_task(run.run_worker(cfg))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert await _readyz_becomes(client, 200)  # consuming, encode stage alive
            store.release.set()
            assert await _readyz_becomes(client, 503)
            assert (await client.get("/healthz")).status_code == 503  # restart me
        assert "the encode stage died" in caplog.text
        assert "durable tier misconfigured" in caplog.text
    finally:
        store.release.set()
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(worker, 60)


def _outside_address() -> str | None:
    """An address of this host besides loopback (None where it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # picks the outgoing route: nothing is sent
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("host", [None, "0.0.0.0"])
async def test_health_and_metrics_listen_on_loopback_unless_configured(settings, monkeypatch,
                                                                       host):
    address = _outside_address()
    if address is None:
        pytest.skip("this host has no address besides loopback to try")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = _DyingStore()
    monkeypatch.setattr(run, "open_encoder_and_store", lambda _settings: (object(), store))
    update = {"worker_http_port": port} | ({"worker_http_host": host} if host else {})
    worker = asyncio.create_task(run.run_worker(settings.model_copy(update=update)))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert await _readyz_becomes(client, 200)
        if host is None:  # the default: this machine only
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((address, port), timeout=5).close()
        else:
            async with httpx.AsyncClient(base_url=f"http://{address}:{port}") as client:
                assert (await client.get("/healthz")).status_code == 200
    finally:
        store.release.set()
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(worker, 60)


async def _readyz_becomes(client: httpx.AsyncClient, status: int, timeout_s: float = 60) -> bool:
    for _ in range(int(timeout_s / 0.25)):
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get("/readyz")).status_code == status:
                return True
        await asyncio.sleep(0.25)
    return False


@pytest.mark.parametrize("point", [
    # a model call that never returns, in the encode stage's thread: the loop reports and exits
    "encode.before_forward",
    # a call that blocks the event loop itself: faulthandler dumps the threads and exits
    "ingest.before_offset_commit",
])
async def test_a_stuck_worker_still_stops_by_its_deadline(settings, tiny_models, tmp_path,
                                                          monkeypatch, point):
    # The shared database and topic hold earlier tests' backlog, which the worker may take first:
    # wait for the point itself, whatever record or fact it fires on.
    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic])
    await publish_turns(settings.kafka_bootstrap, settings.turns_topic,
                        [turn(f"stuck-{uuid.uuid4().hex[:6]}", "t0", "Kim", "I like tea.")],
                        progress=False)
    cfg = settings.model_copy(update={"model_path": tiny_models["llama"], "window": 1,
                                      "kv_dir": tmp_path / "kv", "worker_shutdown_s": 2.0})
    monkeypatch.setenv("INFERSCALE_FAILPOINTS", f"{point}=hang")
    log_path = tmp_path / "worker.log"
    with worker_process(cfg, log_path) as proc:
        for _ in range(360):
            if f"failpoint {point} fired: hang" in log_path.read_text(errors="replace"):
                break
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            await asyncio.sleep(0.5)
        else:
            raise AssertionError("the failpoint was not reached in 180 s:\n"
                                 + log_path.read_text(errors="replace")[-3000:])
        proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        code = await asyncio.to_thread(proc.wait, 60)
        took = time.monotonic() - began
    log = log_path.read_text(errors="replace")
    assert code == 1, log[-3000:]
    assert cfg.worker_shutdown_s <= took < 60
    if point.startswith("encode"):
        assert "did not stop within 2s" in log and "encode: EncodeWorker.run" in log, log[-3000:]
    else:
        assert "Timeout (0:00:07)!" in log and "in hit" in log, log[-3000:]


@pytest.mark.parametrize("name", ["INFERSCALE_WORKER_SHUTDOWN_S", "INFERSCALE_ORPHAN_SWEEP_S",
                                  "INFERSCALE_ENCODE_STUCK_S"])
@pytest.mark.parametrize("value", ["0", "-5", "soon", "nan", "", "1e400"])
def test_worker_timing_settings_refuse_bad_values(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match=name.removeprefix("INFERSCALE_").lower()):
        Settings()


async def test_a_stuck_encode_is_reported_and_its_facts_encoded_by_another_worker(
        settings, engine, tiny_models, tmp_path, monkeypatch):
    """A forward pass that never returns (armed: the batch holding this user's facts hangs in
    the model thread): the stage says so (log with the thread's stack, metric, both probes
    503 with the reason), and once its lease runs out a second worker encodes the facts."""
    from kvrows import with_kv

    from inferscale.contracts.fingerprint import model_fingerprint
    from inferscale.db.tables import fact_kv, facts

    tag = f"stuck{uuid.uuid4().hex[:6]}"
    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic])
    await publish_turns(settings.kafka_bootstrap, settings.turns_topic,
                        [turn(tag, "t0", "Kim", f"My {tag} bike is red."),
                         turn(tag, "t1", "Kim", f"My {tag} cat is grey.")], progress=False)
    cfg = settings.model_copy(update={"model_path": tiny_models["llama"], "window": 1,
                                      "kv_dir": tmp_path / "kv", "encode_stuck_s": 3.0,
                                      "encode_lease_s": 6.0, "worker_shutdown_s": 2.0})
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])

    model = model_fingerprint(tiny_models["llama"])

    async def kv_locations() -> list[str | None]:
        """The KV locations of the user's facts for the workers' model (None: none yet)."""
        async with engine.connect() as conn:
            rows = await conn.execute(with_kv(model, fact_kv.c.kv_location).where(
                facts.c.user_id == tag))
            return [row.kv_location for row in rows]

    monkeypatch.setenv("INFERSCALE_FAILPOINTS", f"encode.before_forward=hang~{tag}")
    stuck_log = tmp_path / "stuck.log"
    with worker_process(cfg.model_copy(update={"worker_http_port": ports[0]}), stuck_log):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports[0]}") as client:
            for _ in range(960):
                with contextlib.suppress(httpx.HTTPError):
                    ready = await client.get("/readyz")
                    if "ModelCallStuck" in ready.text:
                        break
                await asyncio.sleep(0.25)
            else:
                raise AssertionError(stuck_log.read_text(errors="replace")[-3000:])
            assert ready.status_code == 503 and "encode stage died" in ready.text
            alive = await client.get("/healthz")
            assert alive.status_code == 503 and "ModelCallStuck" in alive.text
            metrics = (await client.get("/metrics")).text
            assert 'inferscale_worker_model_calls_stuck_total{stage="encode"} 1.0' in metrics
        log = stuck_log.read_text(errors="replace")
        assert "still running after 3 s" in log and "in hit" in log, log[-3000:]  # where it is
        assert await kv_locations() == [None, None]
        monkeypatch.delenv("INFERSCALE_FAILPOINTS")
        with worker_process(cfg.model_copy(update={"worker_http_port": ports[1]}),
                            tmp_path / "second.log"):
            for _ in range(720):
                locations = await kv_locations()
                if len(locations) == 2 and all(locations):
                    break
                await asyncio.sleep(0.25)
            else:
                raise AssertionError((tmp_path / "second.log").read_text(errors="replace")[-3000:])
