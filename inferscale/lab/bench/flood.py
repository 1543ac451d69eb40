"""A filter flood against the real server: does one caller's costly search stall every other?

An owner with ``FACTS`` facts (random vectors, metadata ``{"n": i % 10}``); 8 concurrent
clients each send searches with a 64-way ``OR`` metadata filter for ``FLOOD_S`` seconds while a
probe reads ``/health`` every 20 ms (what every other tenant's streams wait behind: the
server's event loop). Two servers in one run, one after the other: the defaults (a filter this
costly is ranked by Postgres, off the event loop) and the baseline ``filter_inline_cost``
unbounded (every filter evaluated in Python on the event loop, as before). Each row gives the
probe's latency idle and under the flood (median with a ~95% order-statistics interval, p99)
and the searches' statuses and latency. Searches use the local admin key (not rate-limited:
the flood measures the event loop, not the limiter)."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

from inferscale.core.local_key import key_for
from inferscale.core.settings import Settings
from inferscale.devstack.stack import prepare, server_process
from inferscale.lab.bench.common import percentile, print_table, settings_differing, write_report
from inferscale.lab.bench.retrieval_latency import store_owner
from inferscale.lab.bench.soak_timeline import median_ci

FACTS = 20_000
CLIENTS = 8
FLOOD_S = 20.0
PROBE_S = 0.02
IDLE_PROBES = 200
WHERE = {"OR": [{"n": 100 + i} for i in range(63)] + [{"n": 3}]}  # 64 conditions, 1 in 10 pass


def _latency(samples: list[float]) -> dict:
    ms = [s * 1e3 for s in samples]
    interval = median_ci(ms)
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p50_ci_ms": interval,
            "p99_ms": percentile(ms, 99)}


async def _probe(client: httpx.AsyncClient, url: str, until: float | None, count: int = 0
                 ) -> list[float]:
    samples: list[float] = []
    while (until is None and len(samples) < count) or (until is not None
                                                       and time.monotonic() < until):
        began = time.perf_counter()
        (await client.get(f"{url}/health")).raise_for_status()
        samples.append(time.perf_counter() - began)
        await asyncio.sleep(PROBE_S)
    return samples


async def _flood(url: str, user: str, key: str) -> dict:
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=32)) as client:
        for _ in range(3):  # warm up: the owner's vectors loaded, the code paths run
            await client.post(f"{url}/v1/memory/users/{user}/search", headers=headers,
                              json={"query": "warm up", "k": 5, "filters": WHERE})
        idle = await _probe(client, url, None, IDLE_PROBES)
        until = time.monotonic() + FLOOD_S
        statuses: Counter[int] = Counter()
        searches: list[float] = []

        async def searcher() -> None:
            while time.monotonic() < until:
                began = time.perf_counter()
                response = await client.post(
                    f"{url}/v1/memory/users/{user}/search", headers=headers,
                    json={"query": "which fact is it?", "k": 5, "filters": WHERE})
                statuses[response.status_code] += 1
                searches.append(time.perf_counter() - began)

        probe = asyncio.create_task(_probe(client, url, until))
        await asyncio.gather(*(searcher() for _ in range(CLIENTS)))
        flooded = await probe
    return {"health_idle": _latency(idle), "health_flooded": _latency(flooded),
            "searches": _latency(searches), "search_statuses": dict(statuses),
            "searches_per_s": len(searches) / FLOOD_S}


def run(settings: Settings, out_dir: Path) -> dict:
    """The flood against the defaults and against the unbounded baseline, in one run."""
    settings = prepare(settings)
    user = f"bench-flood-{uuid.uuid4().hex[:8]}"
    store_owner(settings, user, FACTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    for name, update in (("defaults", {}), ("baseline: filters inline", {
            "filter_inline_cost": 10**15, "filter_max_cost": 10**15})):
        served = settings.model_copy(update=update)
        with server_process(served, out_dir / f"server-{len(rows)}.log") as url:
            key = key_for(url, served.data_dir) or ""
            rows[name] = asyncio.run(_flood(url, user, key))
            rows[name]["settings_differing"] = settings_differing(served)
    print_table(["server", "/health idle p50 ms", "flooded p50 ms [95%]", "flooded p99 ms",
                 "search p50 ms", "searches/s", "statuses"],
                [[name, r["health_idle"]["p50_ms"], f"{r['health_flooded']['p50_ms']:.1f} "
                  f"{[round(x, 1) for x in r['health_flooded']['p50_ci_ms'] or []]}",
                  r["health_flooded"]["p99_ms"], r["searches"]["p50_ms"], r["searches_per_s"],
                  r["search_statuses"]] for name, r in rows.items()])
    report = {"settings_differing": settings_differing(settings),
              "data": {"owner_facts": FACTS, "vectors": "random", "metadata": "n = i % 10",
                       "filter": "64-way OR on metadata n (1 in 10 facts pass)"},
              "clients": CLIENTS, "flood_s": FLOOD_S, "probe_every_s": PROBE_S, "rows": rows}
    write_report(out_dir, "flood", report)
    return report
