"""Throughput under concurrent load: Poisson arrivals over a ladder of rates, inject vs text.

Retrieval and prompt composition stay on the critical path (they run in the server's front end
for every request). Goodput = requests per second that met the TTFT target.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx

from inferscale.core.settings import Settings
from inferscale.devstack.chat_client import stream_chat
from inferscale.devstack.stack import server_process, worker_process
from inferscale.lab.bench.common import percentile, print_table, write_report
from inferscale.lab.bench.ttft import ingest_user, prepare_user


async def poisson_load(url: str, user: str, questions: list[str], mode: str, k: int, rate: float,
                       duration_s: float, seed: int) -> list[float | None]:
    """Memory queries with Poisson arrivals for ``duration_s``; TTFT of each (None: failed)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=512)) as c:

        async def one(question: str) -> float | None:
            try:
                return (await stream_chat(c, url, user, question, mode, k, max_tokens=8)).ttft
            except (httpx.HTTPError, RuntimeError):
                return None

        tasks = []
        started = time.perf_counter()
        next_at = 0.0
        while next_at < duration_s:
            await asyncio.sleep(max(0.0, started + next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(rng.choice(questions))))
            next_at += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


def run(settings: Settings, data: Path, out_dir: Path,
        rates: tuple[float, ...] = (0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
        duration_s: float = 30,
        k: int = 20, ttft_target_s: float = 1.0) -> dict:
    """One server; for each mode, a Poisson load of ``duration_s`` seconds per rate, up the
    ladder (steps of 1.33-2x) until the mode saturates (goodput below half the offered rate)."""
    settings, user, questions, turns = prepare_user(settings, data, 100)
    out_dir.mkdir(parents=True, exist_ok=True)
    with worker_process(settings, out_dir / "worker.log", sharing=1):  # no server yet
        ingest_user(settings, user, turns)
    rows = []
    with server_process(settings, out_dir / "server.log") as url:
        asyncio.run(poisson_load(url, user, questions, "inject", k, 1, 3, 0))  # warm-up
        for mode in ("inject", "text"):
            for rate in rates:
                ttfts = asyncio.run(poisson_load(url, user, questions, mode, k, rate,
                                                 duration_s, 1))
                ok = [t for t in ttfts if t is not None]
                good = [t for t in ok if t <= ttft_target_s]
                row: dict[str, Any] = {
                    "rate": rate, "mode": mode, "sent": len(ttfts), "completed": len(ok),
                    "ttft_p50_s": percentile(ok, 50), "ttft_p90_s": percentile(ok, 90),
                    "goodput_rps": len(good) / duration_s}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if row["goodput_rps"] < rate / 2:
                    break
    best = {mode: max(r["goodput_rps"] for r in rows if r["mode"] == mode)
            for mode in ("inject", "text")}
    table = [[rate, *(_cell(rows, rate, mode, key) for key in ("goodput_rps", "ttft_p50_s",
                                                               "ttft_p90_s")
                      for mode in ("inject", "text"))] for rate in rates]
    print(f"k={k}, TTFT target {ttft_target_s}s, {duration_s:.0f}s per point; best goodput "
          f"inject {best['inject']:.2f} req/s, text {best['text']:.2f} req/s")
    print_table(["rate req/s", "goodput inject", "goodput text", "p50 inject", "p50 text",
                 "p90 inject", "p90 text"], table)
    report = {"k": k, "ttft_target_s": ttft_target_s, "duration_s": duration_s, "rows": rows,
              "best_goodput_rps": best}
    write_report(out_dir, "throughput", report)
    return report


def _cell(rows: list[dict], rate: float, mode: str, key: str) -> float | str:
    """One figure of the table; "-" where the mode had saturated below this rate."""
    value = next((r[key] for r in rows if r["rate"] == rate and r["mode"] == mode), "-")
    return "-" if value is None else value
