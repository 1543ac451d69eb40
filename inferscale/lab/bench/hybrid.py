"""vLLM's hybrid KV cache manager on and off, for a model with sliding windows (Gemma 3), on one
ingest: median TTFT over HTTP of text prefill, every fact injected (m = 0) and vLLM's
prefix-cache hit at each k, the connector's write time and the K/V rows it skips per request,
and how many requests of the longest prompt vLLM's KV cache holds. On (the default): local
layers keep only their window's blocks, the connector loads asynchronously (one more engine
step) and writes only the blocks vLLM keeps. Off: every layer holds the whole memory and the
connector writes all of it, synchronously."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from inferscale.core.settings import Settings
from inferscale.devstack.stack import server_process
from inferscale.lab.bench.common import print_table, write_report
from inferscale.lab.bench.ttft import encoded_user, measure

MODES = ("text", "inject-m0", "prefix-hit")
MANAGERS = {"on": [], "off": ["--disable-hybrid-kv-cache-manager"]}
CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def concurrency(log: Path) -> float | None:
    """How many requests of the server's longest prompt its KV cache holds (vLLM's log)."""
    found = CONCURRENCY.search(log.read_text(errors="replace"))
    return float(found.group(2)) if found else None


def run(settings: Settings, data: Path, out_dir: Path, n_queries: int = 10,
        ks: tuple[int, ...] = (20, 50), turns_limit: int = 150) -> dict:
    """Ingest one LoCoMo conversation, then serve it with the manager on, then off."""
    settings, user, questions, turns, encode_s = encoded_user(settings, data, out_dir,
                                                              turns_limit)
    questions = questions[:n_queries]
    rows, held = [], {}
    for manager, args in MANAGERS.items():
        log = out_dir / f"server-{manager}.log"
        with server_process(settings, log, args) as url:
            rows += [{**row, "manager": manager}
                     for row in asyncio.run(measure(url, user, questions, list(ks), MODES))]
        held[manager] = concurrency(log)
    table = []
    for k in ks:
        for manager in MANAGERS:
            by = {r["mode"]: r for r in rows if r["k"] == k and r["manager"] == manager}
            inject = by["inject-m0"]
            table.append([k, manager, by["text"]["ttft_median_s"], inject["ttft_median_s"],
                          by["prefix-hit"]["ttft_median_s"],
                          by["text"]["ttft_median_s"] / inject["ttft_median_s"],
                          inject["engine_ttft_mean_s"] * 1000,
                          inject["stages_ms"]["fused_write"] + inject["stages_ms"]["cache_write"],
                          int(inject["injected_tokens"]), inject["window_skipped_rows"],
                          held[manager] or ""])
    print_table(["k", "hybrid manager", "text p50", "inject m=0 p50", "prefix-hit p50",
                 "text/inject", "engine TTFT inject (ms)", "write ms", "injected tok",
                 "rows skipped", "requests the KV cache holds"], table)
    report = {"n_queries": len(questions), "facts": len(turns), "encode_s": encode_s,
              "requests_held": held, "rows": rows}
    write_report(out_dir, "hybrid", report)
    return report
