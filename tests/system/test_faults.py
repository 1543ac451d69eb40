"""Fault drill with real worker processes, the real broker (tansu on S3 via moto) and Postgres.

While the turns of many users stream in at a steady rate, worker processes are killed with
SIGKILL, at random moments and at failpoints (before the DB commit, between the DB commit and
the offset commit, in the middle of a KV blob write, before its rename, before the KV rows
commit); Postgres restarts; the broker restarts. A supervisor restarts dead workers, as an
orchestrator would. Afterwards every turn is stored once and every fact encoded once with one
verified blob, no temp file or orphan blob is left, nothing was dead-lettered.

Scale: INFERSCALE_DRILL_TURNS, INFERSCALE_DRILL_USERS, INFERSCALE_DRILL_RATE (turns/s);
INFERSCALE_DRILL_REPORT=path.json saves the figures (turns lost/duplicated, facts encoded twice,
recovery times, max lag, peak worker memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from kvrows import with_kv
from sqlalchemy import func, select

from conftest import EXTERNAL_INFRA
from helpers import read_topic, turn
from inferscale.contracts.blob_name import lead_blob
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.core import endpoints
from inferscale.core.settings import Settings
from inferscale.db.tables import fact_kv, facts, turns
from inferscale.devstack import infra
from inferscale.devstack.stack import settings_env
from inferscale.kv.store import KVStore
from inferscale.pipeline.kafka import ensure_topics, make_producer

pytestmark = pytest.mark.slow

TURNS = int(os.environ.get("INFERSCALE_DRILL_TURNS", "1000"))
USERS = int(os.environ.get("INFERSCALE_DRILL_USERS", "25"))
RATE = float(os.environ.get("INFERSCALE_DRILL_RATE", "20"))
REPORT = os.environ.get("INFERSCALE_DRILL_REPORT")
WORKER_SLOTS = 2
MIN_KILLS = 6

# What each worker incarnation is armed with, in turn; None: killed at a random moment.
KILL_PLAN = (None, "ingest.before_db_commit=kill@0.3", "kv.mid_write=kill@0.03",
             "ingest.before_offset_commit=kill@0.3", "kv.before_rename=kill@0.03",
             "encode.before_db_commit=kill@0.3", "extract.before_db_commit=kill@0.3")


@pytest.fixture
def s3_broker(tmp_path, monkeypatch):
    """tansu with its s3:// storage engine on moto_server, so topics survive a restart."""
    import boto3

    port = infra._free_port()
    moto = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ACCESS_KEY_ID": "drill", "AWS_SECRET_ACCESS_KEY": "drill",
           "AWS_DEFAULT_REGION": "eu-west-2", "AWS_ENDPOINT": f"http://127.0.0.1:{port}",
           "AWS_ALLOW_HTTP": "true"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    broker = Settings(data_dir=tmp_path / "broker", kafka_storage="s3://tansu/")
    try:
        for _ in range(100):
            if endpoints.port_open(port):
                break
            time.sleep(0.1)
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT"], region_name="eu-west-2").create_bucket(
            Bucket="tansu", CreateBucketConfiguration={"LocationConstraint": "eu-west-2"})
        yield broker, infra.start_kafka(broker)
    finally:
        infra.down(broker)
        moto.terminate()
        moto.wait(10)


@dataclass
class Drill:
    """What the drill saw while it ran."""

    started: float = field(default_factory=time.monotonic)
    published: int = 0
    publish_retries: int = 0
    progress: list[tuple[float, int, int, int]] = field(default_factory=list)  # t, turns, facts, kv
    deaths: list[dict] = field(default_factory=list)
    stops: list[dict] = field(default_factory=list)  # SIGTERM at the end: exit code, seconds
    outages: list[dict] = field(default_factory=list)
    peak_worker_rss_mb: float = 0.0
    workers_started: int = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def _events(prefix: str, users: int, total: int):
    per_user = -(-total // users)
    events = [turn(f"{prefix}-{u}", f"t{i}", "Kim", f"On day {i} user {u} noted item {i * 7}.",
                   day=1 + i % 28) for i in range(per_user) for u in range(users)]
    return events[:total]


async def _counts(engine, prefix: str, model: str) -> tuple[int, int, int]:
    """The drill's turns, facts, and facts with KV for the workers' model."""
    async with engine.connect() as conn:
        row = (await conn.execute(select(
            select(func.count()).where(turns.c.user_id.like(f"{prefix}-%")).scalar_subquery(),
            select(func.count()).where(facts.c.user_id.like(f"{prefix}-%")).scalar_subquery(),
            with_kv(model, func.count()).where(facts.c.user_id.like(f"{prefix}-%"),
                                               fact_kv.c.kv_location.is_not(None))
            .scalar_subquery(),
        ))).one()
    return tuple(row)


async def _backfill_due(engine, prefix: str, model: str) -> int:
    """Facts of the drill's users still waiting to be encoded again for the workers' model
    (early-fact backfill)."""
    async with engine.connect() as conn:
        return await conn.scalar(with_kv(model, func.count()).where(
            facts.c.user_id.like(f"{prefix}-%"), fact_kv.c.backfill_due))


def _rss_peak_mb(pid: int) -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _publish(drill: Drill, bootstrap: str, topic: str, events) -> None:
    """Publish at RATE turns/s; a chunk whose send fails (broker down) is sent again."""
    producer = make_producer(bootstrap)
    await producer.start()
    chunk = max(1, int(RATE / 10))
    try:
        for start in range(0, len(events), chunk):
            tick = time.monotonic()
            part = events[start:start + chunk]
            while True:
                try:
                    await asyncio.gather(*[await producer.send(topic, e.to_bytes(),
                                                               key=e.user_id.encode())
                                           for e in part])
                    break
                except Exception:  # noqa: BLE001 - the broker is restarting: resend the chunk
                    drill.publish_retries += 1
                    await asyncio.sleep(0.5)
            drill.published += len(part)
            await asyncio.sleep(max(0.0, chunk / RATE - (time.monotonic() - tick)))
    finally:
        await producer.stop()


async def _sample(drill: Drill, engine, prefix: str, model: str,
                  workers: dict[int, subprocess.Popen], stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(Exception):  # Postgres may be restarting
            drill.progress.append((drill.elapsed(), *await _counts(engine, prefix, model),
                                   drill.published))
        for proc in list(workers.values()):
            drill.peak_worker_rss_mb = max(drill.peak_worker_rss_mb, _rss_peak_mb(proc.pid))
        await asyncio.sleep(0.5)


async def _wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 120) -> bool:
    async with httpx.AsyncClient() as client:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"http://127.0.0.1:{port}/readyz", timeout=1)).status_code \
                        == 200:
                    return True
            await asyncio.sleep(0.2)
    return False


async def _supervise(slot: int, drill: Drill, env: dict, logs: Path, plan, rng: random.Random,
                     workers: dict[int, subprocess.Popen], stop: asyncio.Event) -> None:
    """Keep one worker running; kill it (or let its failpoint kill it) again and again."""
    death: dict | None = None
    while not stop.is_set():
        spec = next(plan)
        port = infra._free_port()
        drill.workers_started += 1
        log_path = logs / f"worker-{drill.workers_started}.log"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "inferscale.cli", "worker"], stdout=log,
                stderr=subprocess.STDOUT,
                env={**env, "INFERSCALE_FAILPOINTS": spec or "",
                     "INFERSCALE_WORKER_HTTP_PORT": str(port)})
        workers[slot] = proc
        ready = await _wait_ready(port, proc)
        if death is not None and ready:
            death["recovered_s"] = round(drill.elapsed() - death["at_s"], 2)
        deadline = time.monotonic() + rng.uniform(4, 12)
        while proc.poll() is None and time.monotonic() < deadline and not stop.is_set():
            await asyncio.sleep(0.1)
        if stop.is_set() and proc.poll() is None:
            await _stop(drill, proc, log_path)
            return
        cause = spec.split("=")[0] if proc.poll() is not None else "random moment"
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)
        assert proc.returncode == -signal.SIGKILL, f"worker exited with {proc.returncode}"
        death = {"at_s": drill.elapsed(), "slot": slot, "cause": cause}
        drill.deaths.append(death)


async def _stop(drill: Drill, proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM: the worker finishes its batches, or is stuck and exits by its own deadline
    (``worker_shutdown_s`` 25 s, faulthandler 5 s later); either way within the grace period."""
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = await asyncio.to_thread(proc.wait, 45)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("a worker ignored SIGTERM for 45 s:\n"
                             + log.read_text(errors="replace")[-4000:]) from None
    lines = log.read_text(errors="replace").splitlines()
    stuck = [line for line in lines
             if "did not stop within" in line or line.startswith("Timeout (")]
    # A worker still finishing its batch can reach its armed kill failpoint: the drill's own
    # kill, not a crash (it was alive at SIGTERM, so the point fired after it).
    planned = [line for line in lines if "failpoint" in line and "fired: kill" in line]
    drill.stops.append({"exit_code": code, "took_s": round(time.monotonic() - began, 1),
                        **({"stuck": stuck} if stuck else {}),
                        **({"failpoint": planned} if planned else {})})


def _abandon(workers: dict[int, subprocess.Popen], tasks: list[asyncio.Task]) -> None:
    """A drill that failed or timed out leaves nothing running into the tests after it (they
    share its event loop): its tasks are cancelled, its workers killed."""
    for task in tasks:
        task.cancel()
    for proc in workers.values():
        if proc.poll() is None:
            proc.kill()


async def _stall_evidence(bootstrap: str, cfg: Settings, drill: Drill, logs: Path,
                          broker: Settings) -> str:
    """What a drill whose turns stopped arriving leaves to read in CI's output: per partition
    the group's committed offset and the log end, where the counts stood over time, the final
    worker's warnings and the broker's log."""
    lines = []
    # The group's own consumer API: aiokafka's admin OffsetFetch fails to decode tansu's answer.
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=cfg.consumer_group,
                                enable_auto_commit=False)
    try:
        await consumer.start()
        await consumer.topics()  # metadata, so the topic's partitions are known
        parts = [TopicPartition(cfg.turns_topic, p)
                 for p in sorted(consumer.partitions_for_topic(cfg.turns_topic) or ())]
        ends = await consumer.end_offsets(parts)
        lines += [f"partition {tp.partition}: committed {await consumer.committed(tp)}, "
                  f"end {ends[tp]} (tansu's ListOffsets end is unreliable)" for tp in parts]
    except Exception as exc:  # noqa: BLE001 - evidence is best effort, the assertion stands
        lines.append(f"offsets unavailable: {exc!r}")
    finally:
        await consumer.stop()
    lines += [f"t {t:.0f}s published {p} stored {n} encoded {kv}"
              for t, n, _, kv, p in drill.progress[::20]]
    final = (logs / "worker-final.log").read_text(errors="replace").splitlines()
    lines += [line[:300] for line in final if '"WARNING"' in line or '"ERROR"' in line][-15:]
    lines += (broker.infra_dir / "tansu.log").read_text(errors="replace").splitlines()[-15:]
    return "\n".join(lines)


def _progress_after(drill: Drill, t: float, before: tuple[int, int, int]) -> float | None:
    """Seconds from ``t`` until stored turns or encoded facts first moved past ``before``."""
    for at, n_turns, _, n_kv, _ in drill.progress:
        if at > t and (n_turns > before[0] or n_kv > before[2]):
            return round(at - t, 2)
    return None


async def _outages(drill: Drill, engine, prefix: str, model: str, local: Settings,
                   broker: Settings, published: asyncio.Task) -> None:
    """Restart Postgres at 40% of the stream and the broker at 70%."""
    steps = [(0.4, "postgres restart", lambda: infra.restart_postgres(local)),
             (0.7, "broker restart", lambda: infra.restart_kafka(broker))]
    if EXTERNAL_INFRA:
        steps = steps[1:]
    for fraction, name, restart in steps:
        while drill.published < fraction * TURNS and not published.done():
            await asyncio.sleep(0.2)
        before = await _counts(engine, prefix, model)
        at = drill.elapsed()
        await asyncio.to_thread(restart)
        drill.outages.append({"what": name, "at_s": round(at, 1), "restart_s":
                              round(drill.elapsed() - at, 2), "counts_before": before})


@pytest.mark.parametrize("kv", ["local", "s3"])
async def test_fault_drill_loses_and_duplicates_nothing(base_settings, settings, engine,
                                                        tiny_models, tmp_path, s3_broker, kv,
                                                        monkeypatch, request):
    """``kv``: the durable KV tier is a directory, or a bucket on the broker's moto_server."""
    broker, bootstrap = s3_broker
    kv_url = str(tmp_path / "kv")
    if kv == "s3":
        import boto3

        monkeypatch.setenv("AWS_ENDPOINT_URL", os.environ["AWS_ENDPOINT"])
        boto3.client("s3").create_bucket(
            Bucket="kv-drill", CreateBucketConfiguration={"LocationConstraint": "eu-west-2"})
        kv_url = "s3://kv-drill/drill"
    local = base_settings.model_copy(update={"kafka_bootstrap": None, "database_url": None})
    prefix = f"drill-{uuid.uuid4().hex[:6]}"
    model = model_fingerprint(tiny_models["llama"])  # the workers'; KV is counted for it
    events = _events(prefix, USERS, TURNS)
    cfg = settings.model_copy(update={
        "kafka_bootstrap": bootstrap, "model_path": tiny_models["llama"],
        "kv_url": kv_url, "data_dir": tmp_path, "window": 2,
        "ingest_batch_size": 50, "encode_batch_size": 16})
    # A killed worker's claims come back after a short lease. The drill kills workers whatever
    # they encode, so no fact is to blame: no quarantine after a few deaths here.
    env = {**settings_env(cfg), "INFERSCALE_KAFKA_SESSION_TIMEOUT_MS": "3000",
           "INFERSCALE_LOG_FORMAT": "json", "INFERSCALE_ENCODE_LEASE_S": "5",
           "INFERSCALE_EXTRACT_LEASE_S": "5",
           "INFERSCALE_ENCODE_MAX_CRASHES": "1000"}
    logs = tmp_path / "logs"
    logs.mkdir()
    await ensure_topics(bootstrap, [cfg.turns_topic, cfg.dead_letter_topic])

    drill, stop, workers = Drill(), asyncio.Event(), {}
    rng = random.Random(7)
    plan = itertools.cycle(KILL_PLAN)
    sampler = asyncio.create_task(_sample(drill, engine, prefix, model, workers, stop))
    slots = [asyncio.create_task(_supervise(i, drill, env, logs, plan, rng, workers, stop))
             for i in range(WORKER_SLOTS)]
    publisher = asyncio.create_task(_publish(drill, bootstrap, cfg.turns_topic, events))
    request.addfinalizer(lambda: _abandon(workers, [*slots, sampler, publisher]))
    await _outages(drill, engine, prefix, model, local, broker, publisher)
    await publisher
    stream_s = drill.elapsed()
    for _ in range(2400):  # on a slow machine: keep killing until every kind of kill was seen
        if len(drill.deaths) >= MIN_KILLS and len({d["cause"] for d in drill.deaths}) >= 4:
            break
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*slots, sampler)
    # The slot workers just left the group cleanly. tansu 0.6.0 keeps a leader that sends
    # LeaveGroup while its group is rebalancing, and every later member then waits for that
    # leader's assignment for ever (seen in CI: 370 of 1000 turns stored, the stored group's
    # leader not among its members). A restart reloads the group from storage, which drops such
    # a leader: the operator's remedy, applied here so that the drill tests our workers.
    await asyncio.to_thread(infra.restart_kafka, broker)

    # One clean worker finishes what the faults left behind.
    stop.clear()
    sampler = asyncio.create_task(_sample(drill, engine, prefix, model, workers, stop))
    final_port = infra._free_port()
    with (logs / "worker-final.log").open("ab") as log:
        final = subprocess.Popen([sys.executable, "-m", "inferscale.cli", "worker"], env={
            **env, "INFERSCALE_WORKER_HTTP_PORT": str(final_port)}, stdout=log,
            stderr=subprocess.STDOUT)
    workers[0] = final
    try:
        drain_from = drill.elapsed()
        # The faults may have left nothing to do: wait for the worker itself before reading it.
        assert await _wait_ready(final_port, final), "the final worker never became ready"
        for _ in range(1200):
            if await _counts(engine, prefix, model) == (TURNS,) * 3 and not await _backfill_due(
                    engine, prefix, model):
                break
            await asyncio.sleep(0.5)
        drain_s = drill.elapsed() - drain_from
        metrics = httpx.get(f"http://127.0.0.1:{final_port}/metrics", timeout=10).text
    finally:
        await _stop(drill, final, logs / "worker-final.log")
        stop.set()
        await sampler

    for outage in drill.outages:
        outage["recovered_s"] = _progress_after(drill, outage["at_s"], outage.pop("counts_before"))
    n_turns, n_facts, n_encoded = await _counts(engine, prefix, model)
    async with engine.connect() as conn:
        rows = (await conn.execute(with_kv(model, facts.c.id, fact_kv.c.kv_location,
                                           fact_kv.c.kv_checksum, fact_kv.c.kv_lead_checksum,
                                           fact_kv.c.encode_attempts, facts.c.user_id)
                                   .where(facts.c.user_id.like(f"{prefix}-%"))
                                   .order_by(facts.c.ts, facts.c.id))).all()
        # The drill's workers also encode what other tests left pending in the shared
        # database; those blobs are theirs, not orphans.
        others = set((await conn.execute(select(facts.c.id).where(
            facts.c.user_id.not_like(f"{prefix}-%")))).scalars())
    store = KVStore.from_settings(cfg, model, host_bytes=0)
    expected = set()  # every fact's blob, and its lead blob where one is recorded
    for row in rows:
        store.get(row.kv_location, row.kv_checksum)  # verifies content and fingerprint
        expected.add(f"{row.id}.safetensors")
        if row.kv_lead_checksum:
            store.load(lead_blob(row.id), row.kv_lead_checksum)
            expected.add(f"{lead_blob(row.id)}.safetensors")
    blob_names = {PurePosixPath(location).name for location in store.durable.list()} - {
        "preamble.safetensors", *(f"{name}.safetensors" for fact_id in others
                                  for name in (fact_id, lead_blob(fact_id)))}
    temp_files = list(cfg.kv_path.rglob("*.tmp"))  # S3: nothing on local disk at all
    assert kv == "local" or not cfg.kv_path.exists()
    dead_lettered = await read_topic(bootstrap, cfg.dead_letter_topic, 1, timeout_s=3)
    writes: dict[int, int] = {}
    backfilled: set[int] = set()  # re-encoded once their user had 3 w facts (early-fact backfill)
    for path in logs.glob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if '"fact_ids"' in line and line.startswith("{"):
                entry = json.loads(line)
                backfilled.update(entry["reencoded_ids"])
                for fact_id in entry["fact_ids"]:
                    writes[fact_id] = writes.get(fact_id, 0) + 1
    lag = [published - stored for _, stored, _, _, published in drill.progress]
    backlog = [stored - encoded for _, _, stored, encoded, _ in drill.progress]
    causes = sorted({d["cause"] for d in drill.deaths})
    recovered = sorted(d["recovered_s"] for d in drill.deaths if "recovered_s" in d)
    report = {
        "turns": TURNS, "users": USERS, "rate_turns_per_s": RATE, "stream_s": round(stream_s, 1),
        "drain_after_faults_s": round(drain_s, 1), "worker_processes": drill.workers_started + 1,
        "kills": len(drill.deaths),
        "kills_by_cause": {c: sum(d["cause"] == c for d in drill.deaths) for c in causes},
        "worker_restart_to_ready_s": {"median": recovered[len(recovered) // 2] if recovered
                                      else None, "max": max(recovered, default=None)},
        "outages": drill.outages, "publish_retries": drill.publish_retries,
        # A worker stuck at SIGTERM exits by its deadline (code 1) and its work is redone.
        "stops": drill.stops,
        # Natural keys: a redelivered turn or fact would be a second row under its prefix.
        "turns_lost": max(0, TURNS - n_turns), "turns_duplicated": max(0, n_turns - TURNS),
        "facts_lost": max(0, TURNS - n_facts), "facts_duplicated": max(0, n_facts - TURNS),
        # once each, and once more where the first encoding saw fewer than w facts (backfill)
        "facts_encoded_twice": sum(r.encode_attempts > 1 + (r.id in backfilled) for r in rows),
        "facts_backfilled": len(backfilled),
        "facts_rewritten_after_a_kill": sum(n > 1 + (fact_id in backfilled)
                                            for fact_id, n in writes.items()),
        "blobs": len(blob_names), "orphan_blobs": len(blob_names - expected),
        "temp_files_left": len(temp_files),
        "dead_lettered": len(dead_lettered),
        "max_lag_turns": max(lag, default=0), "max_encode_backlog_facts": max(backlog, default=0),
        "peak_worker_rss_mb": round(drill.peak_worker_rss_mb, 1),
        "final_worker_metrics": {line.split(" ")[0]: float(line.split(" ")[1])
                                 for line in metrics.splitlines()
                                 if line.startswith(("inferscale_worker_turns_stored_total ",
                                                     "inferscale_worker_facts_encoded_total "))},
    }
    print(json.dumps(report, indent=1))
    if REPORT:
        path = Path(REPORT)
        path = path if kv == "local" else path.with_name(f"{path.stem}-s3{path.suffix}")
        path.write_text(json.dumps(report, indent=1) + "\n")

    assert len(drill.deaths) >= MIN_KILLS and len(causes) >= 4, drill.deaths
    assert len(drill.outages) == (1 if EXTERNAL_INFRA else 2)
    assert all(o["recovered_s"] is not None for o in drill.outages), drill.outages
    if (n_turns, n_facts, n_encoded) != (TURNS, TURNS, TURNS):
        evidence = await _stall_evidence(bootstrap, cfg, drill, logs, broker)
        raise AssertionError(f"stored {n_turns}, extracted {n_facts}, encoded {n_encoded} of "
                             f"{TURNS}\n{evidence}")
    assert report["facts_encoded_twice"] == 0
    assert len({r.kv_location for r in rows}) == TURNS
    assert blob_names == expected  # no orphans, no duplicates
    assert not temp_files
    assert not dead_lettered
    # Every worker stopped: cleanly, stuck and by its deadline, or by its own armed failpoint
    # while finishing its batch (not crashed).
    assert all(s["exit_code"] == 0 or s.get("stuck") or (
        s["exit_code"] == -signal.SIGKILL and s.get("failpoint")) for s in drill.stops), drill.stops


async def test_worker_started_before_the_broker_waits_for_it(settings, engine, embedder,
                                                               tmp_path):
    from inferscale.workers.ingest import IngestWorker

    broker = Settings(data_dir=tmp_path / "late-broker")
    port = infra._free_port()
    bootstrap = f"127.0.0.1:{port}"
    user = f"late-{uuid.uuid4().hex[:6]}"
    cfg = settings.model_copy(update={"kafka_bootstrap": bootstrap})
    worker = IngestWorker(cfg, bootstrap, engine)
    running = asyncio.create_task(worker.run())
    try:
        await asyncio.sleep(3)
        assert not running.done(), "the worker gave up while the broker was down"
        infra.start_kafka(broker, port)
        await ensure_topics(bootstrap, [cfg.turns_topic])
        producer = make_producer(bootstrap)
        await producer.start()
        for i in range(5):
            await producer.send_and_wait(cfg.turns_topic, turn(user, f"t{i}", "Kim",
                                                               f"Fact {i}.").to_bytes(),
                                         key=user.encode())
        await producer.stop()
        for _ in range(120):
            if worker.stats.turns_stored == 5:
                break
            await asyncio.sleep(0.5)
        assert worker.stats.turns_stored == 5
    finally:
        worker.request_stop()
        await asyncio.wait_for(running, 60)
        infra.down(broker)
