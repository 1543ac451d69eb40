"""`inferscale bench soak`: a fleet's day, live. A population of users (Zipf activity, LoCoMo
memories) under KV budgets small enough to evict, turns streaming in, clients asking through the
OpenAI API and editing memory through the memory API, and faults on a schedule (kill -9 of a
worker mid-encode, kill -9 of the server, a broker restart, a Postgres restart, a full disk and
a slow store under the durable tier for ``fault_s``); figures per minute and the end-of-run
checks (``soak_checks``), JSON and plots.

The full disk and the slow store are failpoints armed in the running worker and server for
their window (``INFERSCALE_FAILPOINTS_FILE``): every durable write fails with ENOSPC; every
durable read and write waits ``SLOW_STORE_S`` first.

One worker process and one server share the host, each restarted when it dies, as an
orchestrator would. The embedded broker runs on S3 storage (moto_server), so its restart keeps
the topic (with ``memory://`` a restart loses what it held: not a fault the product survives).
Every request carries a fresh cache salt, so TTFT is never a prefix-cache hit between requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from sqlalchemy import text

from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.core import endpoints
from inferscale.core.local_key import read_key
from inferscale.core.model_prep import resolve_model_path
from inferscale.core.settings import Settings, settings_env
from inferscale.db.engine import create_engine
from inferscale.devstack import infra
from inferscale.devstack.chat_client import parse_metrics, totals
from inferscale.devstack.stack import prepare, sharing_cores
from inferscale.kv.store import KVStore
from inferscale.lab.bench import cost, soak_checks
from inferscale.lab.bench.common import print_table, settings_differing, source, write_report
from inferscale.lab.bench.soak_load import LoadLog, client_loop, publish_loop
from inferscale.lab.bench.soak_population import Population, build
from inferscale.lab.bench.soak_timeline import Accumulator, per_minute, plot, summarise
from inferscale.pipeline.kafka import ensure_topics, kafka_security, publish_turns
from inferscale.serving.serve import start_server, stop_server, wait_ready

SLOW_STORE_S = 0.5
# Faults that last ``fault_s``: what every process then finds at the durable tier.
SPELLS = {"disk_full": "kv.mid_write=error:ENOSPC,kv.before_rename=error:ENOSPC",
          "slow_store": f"kv.read=delay:{SLOW_STORE_S},kv.mid_write=delay:{SLOW_STORE_S}"}
FAULTS = ("worker", "broker", "postgres", "server", *SPELLS)


@dataclass(frozen=True)
class SoakConfig:
    """The run's shape (the report records it)."""

    minutes: float = 30.0
    users: int = 60
    memory_turns: int = 6  # each user's memory at the start
    clients: int = 4
    request_rate: float = 1.0  # questions and edits per second, all clients together
    turn_rate: float = 0.1  # turns published per second
    k: int = 5
    edit_share: float = 0.05
    pair_share: float = 0.2  # questions asked again as text (the TTFT ratio's pairs)
    budget_mb: float = 80.0
    user_budget_mb: float = 3.0
    grace_s: float = 30.0
    evict_interval_s: float = 15.0
    faults: tuple[str, ...] = FAULTS
    fault_s: float = 60.0  # how long a full disk or a slow store lasts
    zipf_a: float = 1.1
    seed: int = 0
    drain_s: float = 600.0  # after the load: time for every published turn to be stored
    # The budget check allows what the policy allowed at any moment this long before a sample
    # (eviction rounds run before encode batches: a round waits for a slow batch).
    bound_window_s: float = 90.0
    server_args: tuple[str, ...] = ()


@dataclass
class Restarts:
    """How the run restarts infrastructure it owns (None: not owned, that fault is skipped)."""

    broker: Callable[[], None] | None = None
    postgres: Callable[[], None] | None = None


@dataclass
class Processes:
    """The worker and the server the soak runs, and what happened to them."""

    settings: Settings
    logs: Path
    url: str
    worker: subprocess.Popen | None = None
    server: subprocess.Popen | None = None
    settings_args: tuple[str, ...] = ()
    failpoints: Path = Path()  # the spec file the worker and the server watch
    deaths: list[dict] = field(default_factory=list)
    incarnations: int = 0
    stopping: bool = False

    def start_worker(self) -> None:
        self.incarnations += 1
        with (self.logs / f"worker-{self.incarnations}.log").open("ab") as log:
            self.worker = subprocess.Popen(
                [sys.executable, "-m", "inferscale.cli", "worker"],
                env=settings_env(sharing_cores(self.settings, 2)), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    async def supervise(self) -> None:
        """Restart the worker whenever it dies (an orchestrator's job)."""
        while not self.stopping:
            if self.worker is not None and self.worker.poll() is not None:
                self.deaths.append({"at": time.time(), "code": self.worker.returncode})
                self.start_worker()
            await asyncio.sleep(0.5)

    def start_server(self) -> None:
        """`inferscale serve`, blocking until it is healthy."""
        self.server = start_server(self.settings, list(self.settings_args),
                                   log_path=self.logs / "server.log")
        wait_ready(self.url, self.server, 900)

    def kill_server(self) -> None:
        """SIGKILL the server's whole process group (API server, engine, workers)."""
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait()

    def stop(self) -> None:
        self.stopping = True
        for proc in (self.server, self.worker):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


@contextlib.contextmanager
def durable_broker(settings: Settings) -> Iterator[tuple[str, Callable[[], None]]]:
    """The embedded broker (tansu) on S3 storage served by moto_server, in ``settings``'
    infra folder: its bootstrap address and how to restart it (topics and offsets survive). On
    exit, the infra of that folder stops (Postgres too, where it was started there)."""
    port = infra._free_port()
    moto = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ACCESS_KEY_ID": "soak", "AWS_SECRET_ACCESS_KEY": "soak",
           "AWS_DEFAULT_REGION": "eu-west-2", "AWS_ENDPOINT": f"http://127.0.0.1:{port}",
           "AWS_ALLOW_HTTP": "true"}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # tansu reads its storage's credentials from the environment
    broker = settings.model_copy(update={"kafka_storage": "s3://tansu/"})
    try:
        import boto3

        deadline = time.monotonic() + 30
        while not endpoints.port_open(port):
            if moto.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto_server did not start")
            time.sleep(0.1)
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT"], region_name="eu-west-2",
                     aws_access_key_id="soak", aws_secret_access_key="soak").create_bucket(
            Bucket="tansu", CreateBucketConfiguration={"LocationConstraint": "eu-west-2"})
        yield infra.start_kafka(broker), lambda: infra.restart_kafka(broker)
    finally:
        infra.down(broker)
        moto.terminate()
        moto.wait(10)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def owned_stack(settings: Settings) -> Iterator[tuple[Settings, Restarts]]:
    """Embedded Postgres and a durable broker of the soak's own (a fresh data folder), so it
    may restart them; the prepared model of ``settings``."""
    model_path = resolve_model_path(settings)
    root = Path(tempfile.mkdtemp(prefix="inferscale-soak-"))
    own = settings.model_copy(update={"data_dir": root, "model_path": model_path,
                                      "kafka_bootstrap": None, "database_url": None,
                                      "kv_dir": None, "kv_url": None})
    with durable_broker(own) as (bootstrap, restart):  # `prepare` then reuses it
        own = prepare(own.model_copy(update={"kafka_bootstrap": bootstrap,
                                             "kafka_storage": "s3://tansu/"}))
        yield own, Restarts(broker=restart, postgres=lambda: infra.restart_postgres(own))


WORKER_COUNTERS = {"encoded": "inferscale_worker_facts_encoded_total",
                   "evicted_facts": "inferscale_worker_kv_evicted_facts_total",
                   "evicted_bytes": "inferscale_worker_kv_evicted_bytes_total",
                   "restored": "inferscale_worker_kv_restored_facts_total",
                   "encode_failures": "inferscale_worker_encode_failures_total"}
QUEUE = text("""
    SELECT count(*) FILTER (WHERE k.kv_location IS NULL AND k.kv_evicted_at IS NOT NULL)
               AS evicted,
           count(*) FILTER (WHERE k.kv_wanted_at IS NOT NULL) AS wanted,
           count(*) FILTER (WHERE k.kv_location IS NULL AND k.kv_evicted_at IS NULL) AS pending,
           count(*) FILTER (WHERE k.claimed_until > now()) AS claimed
    FROM fact_kv k JOIN facts f ON f.id = k.fact_id WHERE f.deleted_at IS NULL
""")


async def _sample(engine, procs: Processes, config: SoakConfig, budget: int | None,
                  user_budget: int | None, samples: list[dict], stop: asyncio.Event) -> None:
    """Every 10 s: the tier against its budgets and the queues (Postgres), the worker's and the
    server's counters (summed over restarts), the KV folder's bytes on disk."""
    worker_acc, server_acc = Accumulator(), Accumulator()
    async with httpx.AsyncClient(timeout=5) as http:
        while not stop.is_set():
            sample: dict = {"at": time.time(), "loadavg_1m": os.getloadavg()[0]}
            try:
                async with engine.connect() as conn:
                    held = await soak_checks.budget_sample(conn, sample["at"], config.grace_s,
                                                           config.bound_window_s)
                    sample.update((await conn.execute(QUEUE)).one()._asdict())
                sample["kv_held_bytes"] = held.total
                sample["kv_user_max_bytes"] = max(held.held.values(), default=0)
                sample["tier_excess"], sample["user_excess"] = soak_checks.budget_excess(
                    held, budget, user_budget)
            except Exception as exc:  # noqa: BLE001 - Postgres may be restarting: noted
                sample["db_error"] = type(exc).__name__
            with contextlib.suppress(httpx.HTTPError):
                metrics = parse_metrics((await http.get(
                    f"http://127.0.0.1:{procs.settings.worker_http_port}/metrics")).text)
                worker_acc.update({k: totals(metrics, name) for k, name in
                                   WORKER_COUNTERS.items()})
            with contextlib.suppress(httpx.HTTPError):
                metrics = parse_metrics((await http.get(f"{procs.url}/metrics")).text)
                server_acc.update({
                    **{f"lookups_{tier}_{result}": totals(
                        metrics, "inferscale_kv_cache_lookups_total", tier=tier, result=result)
                       for tier in ("device", "host", "durable") for result in ("hit", "miss")},
                    "reencodes_wanted": totals(metrics, "inferscale_kv_reencodes_wanted_total"),
                    "load_failures": totals(metrics, "inferscale_kv_load_failures_total")})
            sample["kv_disk_bytes"] = sum(p.stat().st_size for p in
                                          procs.settings.kv_path.rglob("*") if p.is_file())
            sample["totals"] = {**worker_acc.total, **server_acc.total}
            samples.append(sample)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 10)


async def _claim_in_flight(engine, timeout_s: float = 120) -> bool:
    """Wait until some fact's encode is claimed (a worker is mid-encode); False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            async with engine.connect() as conn:
                if (await conn.execute(QUEUE)).one().claimed:
                    return True
        await asyncio.sleep(0.25)
    return False


async def _worker_ready(procs: Processes, timeout_s: float = 600) -> None:
    """Wait until a worker answers /readyz (the supervisor restarts a dead one)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                url = f"http://127.0.0.1:{procs.settings.worker_http_port}/readyz"
                if procs.worker is not None and procs.worker.poll() is None and (
                        await http.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.5)


async def _encode_failures(procs: Processes) -> float:
    """The worker's failed encodes so far (this incarnation's; 0 when it does not answer)."""
    with contextlib.suppress(httpx.HTTPError):
        async with httpx.AsyncClient(timeout=5) as http:
            return totals(parse_metrics((await http.get(
                f"http://127.0.0.1:{procs.settings.worker_http_port}/metrics")).text),
                WORKER_COUNTERS["encode_failures"])
    return 0.0


async def _faults(procs: Processes, restarts: Restarts, engine, config: SoakConfig,
                  began: float, log: list[dict]) -> None:
    """Each fault of ``config.faults`` once, evenly spread over the run."""
    plan = [f for f in config.faults if f in ("worker", "server", *SPELLS)
            or getattr(restarts, f) is not None]
    for n, what in enumerate(plan):
        await asyncio.sleep(max(0.0, began + (n + 1) / (len(plan) + 1) * config.minutes * 60
                                - time.time()))
        entry: dict = {"what": what}
        if what == "worker":
            entry["mid_encode"] = await _claim_in_flight(engine)
            entry["at"] = time.time()
            assert procs.worker is not None
            os.killpg(procs.worker.pid, signal.SIGKILL)
            await _worker_ready(procs)
        elif what == "server":
            entry["at"] = time.time()
            procs.kill_server()
            await asyncio.to_thread(procs.start_server)
        elif what in SPELLS:
            before = await _encode_failures(procs)
            entry["at"] = time.time()
            procs.failpoints.write_text(SPELLS[what])
            await asyncio.sleep(config.fault_s)
            procs.failpoints.write_text("")
            entry["encode_failures"] = await _encode_failures(procs) - before
        else:
            entry["at"] = time.time()
            await asyncio.to_thread(getattr(restarts, what))
        entry["back_after_s"] = round(time.time() - entry["at"], 2)
        log.append(entry)
        print(f"fault: {entry}", flush=True)


async def _drain(engine, prefix: str, published: set, timeout_s: float) -> float:
    """Wait until every published turn is stored and extracted; the seconds waited."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        with contextlib.suppress(Exception):
            async with engine.connect() as conn:
                _, facts = await soak_checks.stored_rows(conn, prefix)
            if all(facts[key] for key in published):
                break
        await asyncio.sleep(2)
    return time.monotonic() - began


def _model_comparison(settings: Settings, config: SoakConfig, live: dict) -> dict:
    """``bench cost``'s population model (fact by fact) run with the live run's parameters
    (users, facts each, bytes per fact, both budgets, grace, rounds, request and new-fact rates,
    encode rate, k, the live TTFTs), side by side with what the run measured. A model: every
    fact encoded at its start, retrieval uniform over a user's facts, no recompute attempts."""
    ttft = {"host": live["ttft_injected_p50_s"], "disk": live["ttft_injected_p50_s"],
            "cold": live["ttft_text_fallback_p50_s"] or live["ttft_text_prefill_p50_s"]}
    if None in ttft.values():
        return {"skipped": "no injected or no text answer to time the model's requests with"}
    policy = cost.Policy(budget_bytes=config.budget_mb * 1e6, grace_s=config.grace_s,
                         interval_s=config.evict_interval_s,
                         headroom=settings.kv_budget_headroom,
                         encode_rate=max(live["encoded_per_s"], 1e-6),
                         host_bytes=settings.host_cache_bytes,
                         user_budget_bytes=config.user_budget_mb * 1e6 or None)
    at_start = np.full(config.users, config.memory_turns)  # a fact a turn, then the stream
    model = cost.simulate(at_start, live["bytes_per_fact"], policy, live["question_rate"],
                          config.zipf_a, config.minutes / 60, ttft, config.seed, config.k,
                          new_fact_rate=config.turn_rate)
    model.pop("timeline")
    return {"model": model, "ttft_s_used": ttft,
            "measured": {k: live[k] for k in ("hit_rate_all_injected", "hit_rate_any_injected",
                                              "reencoded_facts_per_hour", "ttft_p50_s",
                                              "ttft_p99_s")}}


async def soak(settings: Settings, data: Path, out_dir: Path, config: SoakConfig,
               restarts: Restarts) -> dict:
    """The run on infrastructure ``settings`` points at; the report."""
    code_commit = source()["commit"]  # the code that runs (not a commit made during the run)
    out_dir.mkdir(parents=True, exist_ok=True)
    logs = out_dir / "logs"
    logs.mkdir(exist_ok=True)
    budget = int(config.budget_mb * 1e6) if config.budget_mb else None
    user_budget = int(config.user_budget_mb * 1e6) if config.user_budget_mb else None
    settings = settings.model_copy(update={
        "kv_budget_bytes": budget, "kv_user_budget_bytes": user_budget,
        "kv_evict_grace_s": config.grace_s, "kv_evict_interval_s": config.evict_interval_s,
        "server_port": infra._free_port(), "worker_http_port": infra._free_port()})
    model = model_fingerprint(resolve_model_path(settings))
    prefix = f"soak-{uuid.uuid4().hex[:6]}"
    population: Population = build(data, prefix, config.users, config.zipf_a, config.seed)
    bootstrap = str(settings.kafka_bootstrap)
    await ensure_topics(bootstrap, [settings.turns_topic, settings.dead_letter_topic],
                        security=kafka_security(settings))
    procs = Processes(settings, logs, f"http://127.0.0.1:{settings.server_port}",
                      settings_args=config.server_args, failpoints=out_dir / "failpoints")
    procs.failpoints.write_text("")
    watched = os.environ.get("INFERSCALE_FAILPOINTS_FILE")
    os.environ["INFERSCALE_FAILPOINTS_FILE"] = str(procs.failpoints)  # the children's
    engine = create_engine(settings.database_url)
    load = LoadLog([], [], [], {})
    samples: list[dict] = []
    fault_log: list[dict] = []
    stop, sampling = asyncio.Event(), asyncio.Event()
    try:
        procs.start_worker()
        supervisor = asyncio.create_task(procs.supervise())
        seed = [t for user in population.users for t in user.take(config.memory_turns)]
        await publish_turns(bootstrap, settings.turns_topic, seed, progress=False,
                            security=kafka_security(settings))
        load.published.update({(t.user_id, t.turn_id): time.time() for t in seed})
        started = time.monotonic()
        await asyncio.to_thread(procs.start_server)
        print(f"server ready after {time.monotonic() - started:.0f}s; soak of "
              f"{config.minutes} min begins", flush=True)
        api_key = read_key(settings.data_dir) or ""
        began = time.time()
        sampler = asyncio.create_task(_sample(engine, procs, config, budget, user_budget,
                                              samples, sampling))
        tasks = [asyncio.create_task(client_loop(
            procs.url, api_key, population, load, config.request_rate / config.clients,
            config.k, config.edit_share, config.pair_share, stop, config.seed + n))
            for n in range(config.clients)]
        tasks.append(asyncio.create_task(publish_loop(settings, bootstrap, population, load,
                                                      config.turn_rate, stop)))
        faults = asyncio.create_task(_faults(procs, restarts, engine, config, began, fault_log))
        await asyncio.sleep(config.minutes * 60)
        await faults
        stop.set()
        await asyncio.gather(*tasks)
        ended = time.time()
        if procs.server is not None:  # the drain needs the worker alone
            await asyncio.to_thread(stop_server, procs.server)
        drain_s = await _drain(engine, prefix, set(load.published), config.drain_s)
        sampling.set()
        procs.stopping = True
        await asyncio.gather(sampler, supervisor)
        report = await _report(settings, data, config, engine, model, prefix, load, samples,
                               fault_log, procs, began, ended, drain_s, budget, user_budget,
                               out_dir, code_commit)
    finally:
        stop.set()
        sampling.set()
        procs.stop()
        await engine.dispose()
        os.environ.pop("INFERSCALE_FAILPOINTS_FILE")
        if watched is not None:
            os.environ["INFERSCALE_FAILPOINTS_FILE"] = watched
    return report


async def _report(settings: Settings, data: Path, config: SoakConfig, engine, model: str,
                  prefix: str, load: LoadLog, samples: list[dict], fault_log: list[dict],
                  procs: Processes, began: float, ended: float, drain_s: float, budget: int | None,
                  user_budget: int | None, out_dir: Path, code_commit: str | None) -> dict:
    """The end-of-run checks, the figures per minute and overall, the model beside them."""
    (out_dir / "soak-answers.jsonl").write_text("".join(  # first: the raw log survives
        json.dumps(asdict(a)) + "\n" for a in load.answers))
    (out_dir / "soak-samples.json").write_text(json.dumps(samples))
    async with engine.connect() as conn:
        stored, facts = await soak_checks.stored_rows(conn, prefix)
        owners = await soak_checks.fact_owners(conn, (f for a in load.answers
                                                     for f in a.fact_ids))
        live_rows = await soak_checks.live_kv(conn, prefix, model)
        per_user = (await conn.execute(text(
            "SELECT count(*) FROM facts WHERE user_id LIKE :p AND deleted_at IS NULL "
            "GROUP BY user_id"), {"p": f"{prefix}-%"})).scalars().all()
        bytes_per_fact = (await conn.execute(text(
            "SELECT avg(kv_bytes) FROM fact_kv WHERE kv_bytes IS NOT NULL"))).scalar_one()
    store = KVStore.from_settings(settings, model, host_bytes=0)
    states = []
    for row in live_rows:
        verified = None
        if row.kv_location is not None:
            try:
                store.get(row.kv_location, row.kv_checksum)
                verified = True
            except Exception:  # noqa: BLE001 - missing or corrupt: counted, not raised
                verified = False
        states.append(soak_checks.kv_state(row, verified, settings.encode_max_attempts))
    during = [a for a in load.answers if began <= a.started < ended]
    kv_states = {s: states.count(s) for s in sorted(set(states))}
    budget_samples = [s for s in samples if "tier_excess" in s]
    checks: dict[str, Any] = {
        "turns": soak_checks.turn_check(load.published, stored, facts),
        "kv": kv_states,
        "stale_answers": soak_checks.stale_answers(load.answers, load.edits),
        "foreign_answers": soak_checks.foreign_answers(load.answers, owners),
        "budget": {
            "samples": len(budget_samples),
            "tier_over_bound": [s["at"] - began for s in budget_samples if s["tier_excess"]],
            "user_over_bound": [s["at"] - began for s in budget_samples if s["user_excess"]],
            "max_held_over_budget": max((s["kv_held_bytes"] / budget for s in budget_samples),
                                        default=None) if budget else None,
            "max_user_over_user_budget": max((s["kv_user_max_bytes"] / user_budget
                                              for s in budget_samples), default=None)
            if user_budget else None},
    }
    checks["passed"] = passed(checks)
    overall = summarise(during)
    totals_end = samples[-1]["totals"] if samples else {}
    hours = (ended - began) / 3600
    asked = [a for a in during if a.kind != "text-prefill"]
    answered = [a for a in asked if a.error is None]
    live = {
        "facts_per_user": list(per_user), "bytes_per_fact": float(bytes_per_fact or 0),
        "question_rate": len(asked) / (ended - began),
        "encoded_per_s": totals_end.get("encoded", 0) / max(ended - began, 1),
        "hit_rate_all_injected": sum(a.kind == "injected" for a in answered) / max(len(answered),
                                                                                    1),
        "hit_rate_any_injected": sum(a.kind in ("injected", "partial", "recomputed")
                                     for a in answered) / max(len(answered), 1),
        "reencoded_facts_per_hour": totals_end.get("restored", 0) / hours,
        "ttft_p50_s": float(np.percentile([a.ttft for a in answered], 50)) if answered else None,
        "ttft_p99_s": float(np.percentile([a.ttft for a in answered], 99)) if answered else None,
        "ttft_injected_p50_s": overall["kinds"]["injected"]["ttft_p50_s"],
        "ttft_text_fallback_p50_s": overall["kinds"]["text-fallback"]["ttft_p50_s"],
        "ttft_text_prefill_p50_s": overall["kinds"]["text-prefill"]["ttft_p50_s"],
    }
    minutes = max(1, round((ended - began) / 60))
    rows = per_minute(during, samples, began, minutes)
    quarter = max(1, minutes // 4)
    first, last = (summarise([a for a in during if lo <= (a.started - began) / 60 < hi])
                   for lo, hi in ((0, quarter), (minutes - quarter, minutes)))
    report = {
        "config": {**asdict(config), "faults": list(config.faults)},
        "settings_differing": settings_differing(settings),
        "data": {"file": str(data), "users": config.users,
                 "turns_published": len(load.published), "questions": len(asked),
                 "edits": len(load.edits)},
        "model": str(resolve_model_path(settings)), "commit": code_commit,
        "began": began, "ended": ended, "drain_s": round(drain_s, 1),
        "faults": fault_log, "worker_deaths": procs.deaths,
        "publish_retries": load.publish_retries, "edit_errors": len(load.edit_errors),
        "overall": overall, "live": {k: v for k, v in live.items() if k != "facts_per_user"},
        "first_quarter": first, "last_quarter": last,
        "ratio_last_over_first_quarter": (
            last["ttft_ratio_text_over_inject"] / first["ttft_ratio_text_over_inject"]
            if first["ttft_ratio_text_over_inject"] and last["ttft_ratio_text_over_inject"]
            else None),
        "cost_model": _model_comparison(settings, config, live),
        "checks": checks, "per_minute": rows, "samples": samples,
    }
    write_report(out_dir, "soak", report)
    plot(rows, [s for s in samples if "kv_held_bytes" in s], began, budget, fault_log,
         out_dir / "soak.png")
    print_table(["minute", "requests", "injected", "partial", "text-fallback", "inject p50",
                 "text-prefill p50", "ratio", "errors", "KV held MB"],
                [[r["minute"], r["requests"], r["kinds"]["injected"]["share"],
                  r["kinds"]["partial"]["share"], r["kinds"]["text-fallback"]["share"],
                  r["kinds"]["injected"]["ttft_p50_s"] or "-",
                  r["kinds"]["text-prefill"]["ttft_p50_s"] or "-",
                  r["ttft_ratio_text_over_inject"] or "-", sum(r["errors"].values()),
                  (r.get("kv_held_bytes_max") or 0) / 1e6] for r in rows])
    print(json.dumps({k: v for k, v in checks.items() if k != "budget"} | {
        "budget": {k: v for k, v in checks["budget"].items() if "over_bound" not in k}},
        indent=1, default=str))
    return report


def passed(checks: dict) -> bool:
    """Every end-of-run check held."""
    turns, kv, budget = checks["turns"], checks["kv"], checks["budget"]
    return (turns["lost"] == turns["duplicated"] == turns["facts_lost"]
            == turns["facts_duplicated"] == 0
            and not any(kv.get(s) for s in ("broken", "quarantined", "failed"))
            and not checks["stale_answers"] and not checks["foreign_answers"]
            and budget["samples"] > 0  # a check that never ran holds nothing
            and not budget["tier_over_bound"] and not budget["user_over_bound"])


def run(settings: Settings, data: Path, out_dir: Path, config: SoakConfig) -> dict:
    """`inferscale bench soak`: on infrastructure of its own (embedded Postgres, the broker on
    moto's S3), or on the configured endpoints (then no broker or Postgres restarts)."""
    for name in ("httpx", "httpx2"):  # the clients' request lines: thousands
        logging.getLogger(name).setLevel(logging.WARNING)
    with contextlib.ExitStack() as stack:
        if settings.kafka_bootstrap and settings.database_url:
            settings, restarts = prepare(settings), Restarts()
        else:
            settings, restarts = stack.enter_context(owned_stack(settings))
        return asyncio.run(soak(settings, data, out_dir, config, restarts))
