"""TTFT vs k over HTTP: inject (host tier, disk tier; the server's default tail recompute, and
m = 0 and m = 2 beside it) vs vLLM's prefix-cache hit vs text prefill vs no memory, same facts
and order, with the host time of each stage per request and, under recompute auto, the share
of requests answered again with the tail recomputed (or every fact as text) and their TTFT."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path

import httpx

from inferscale.core.endpoints import resolve_kafka_bootstrap
from inferscale.core.settings import Settings
from inferscale.db.engine import create_engine
from inferscale.devstack.chat_client import ChatResult, scrape, stream_chat, totals
from inferscale.devstack.stack import prepare, server_process, wait_encoded, worker_process
from inferscale.lab.bench.common import auto_costs, percentile, print_table, write_report
from inferscale.lab.bench.cpu import per_process, thread_times
from inferscale.pipeline.kafka import ensure_topics, kafka_security, publish_turns
from inferscale.pipeline.sources import read_turns

MODES = ("inject", "inject-m0", "inject-m2", "prefix-hit", "text", "none")
DISK_MODE = "inject-disk"  # inject on a server whose memory tiers hold nothing
# Tail recompute per inject mode (None: the server's default, recompute auto on a CPU).
RECOMPUTE = {"inject": None, "inject-m0": 0, "inject-m2": 2, DISK_MODE: None}
# Host time per request, by stage: (label, metric, stage label or None).
STAGES = (("retrieval", "inferscale_retrieval_seconds_sum", None),
          ("compose", "inferscale_stage_seconds_sum", "compose"),
          ("sign", "inferscale_stage_seconds_sum", "sign"),
          ("plan_check", "inferscale_stage_seconds_sum", "plan_check"),
          ("page_in", "inferscale_kv_page_in_seconds_sum", None),
          ("gather", "inferscale_stage_seconds_sum", "gather"),
          ("rope", "inferscale_stage_seconds_sum", "rope"),
          ("cache_write", "inferscale_stage_seconds_sum", "cache_write"),
          ("fused_write", "inferscale_stage_seconds_sum", "fused_write"))


async def _ask(client: httpx.AsyncClient, url: str, user: str, question: str, mode: str, k: int
               ) -> tuple[ChatResult, dict, dict]:
    """One timed request and the server's metrics just before and after it. ``prefix-hit``
    first sends the text prompt once with a salt (not counted), then again with the same salt:
    vLLM's own prefix cache serves the second. ``inject`` first sends the question once with
    another salt (not counted): its facts are then in the host tier, not in vLLM's prefix cache,
    so the timed request injects them all from host memory (``inject-m0`` / ``-m2`` likewise,
    with that tail recompute). ``inject-disk`` is not primed."""
    salt = None
    recompute = RECOMPUTE.get(mode)
    options = {"recompute": recompute} if recompute is not None else None
    if mode == "prefix-hit":
        salt = uuid.uuid4().hex
        await stream_chat(client, url, user, question, "text", k, max_tokens=1, salt=salt)
    elif mode.startswith("inject") and mode != DISK_MODE:
        await stream_chat(client, url, user, question, "inject", k, max_tokens=1,
                          options=options)
    before = await scrape(client, url)
    served = ("text" if mode == "prefix-hit" else "inject" if mode.startswith("inject")
              else mode)
    result = await stream_chat(client, url, user, question, served, k, salt=salt,
                               options=options)
    return result, before, await scrape(client, url)


def _delta(pairs: list[tuple[dict, dict]], metric: str, **labels: str) -> float:
    return sum(totals(after, metric, **labels) - totals(before, metric, **labels)
               for before, after in pairs)


def computed_tokens(pairs: list[tuple[dict, dict]]) -> float:
    """Prompt tokens the engine computed per request: neither a prefix-cache hit nor injected.
    A hit covers whole blocks only, so it recomputes the prompt's last partial block."""
    return (_delta(pairs, "vllm:prompt_tokens_total")
            - _delta(pairs, "vllm:prefix_cache_hits_total")
            - _delta(pairs, "inferscale_kv_injected_tokens_total")) / max(1, len(pairs))


async def measure(url: str, user: str, questions: list[str], ks: list[int],
                  modes: tuple[str, ...] = MODES) -> list[dict]:
    """Per (k, mode): median/p90 of HTTP TTFT, vLLM's mean engine TTFT, the mean host time
    per request of each stage, and the wall time and each process's CPU time per request
    (untimed priming requests included)."""
    rows = []
    async with httpx.AsyncClient(timeout=300) as client:
        for question in questions[:2]:  # warm-up: compile paths, load caches
            for mode in modes:
                await _ask(client, url, user, question, mode, max(ks))
        for k in ks:
            for mode in modes:
                cpu_before, started = thread_times(), time.perf_counter()
                asked = [await _ask(client, url, user, q, mode, k) for q in questions]
                wall_ms = (time.perf_counter() - started) * 1000 / len(asked)
                cpu = per_process(cpu_before, thread_times(), len(asked))
                results, pairs = [a[0] for a in asked], [a[1:] for a in asked]
                ttfts = [r.ttft for r in results]
                rows.append({
                    "k": k, "mode": mode, "n": len(results),
                    "ttft_median_s": statistics.median(ttfts), "ttft_p90_s": percentile(ttfts, 90),
                    "engine_ttft_mean_s": _delta(pairs, "vllm:time_to_first_token_seconds_sum")
                    / max(1, _delta(pairs, "vllm:time_to_first_token_seconds_count")),
                    "prompt_tokens": statistics.median(
                        int(r.headers.get("x-inferscale-prompt-tokens", 0)) for r in results),
                    "injected_tokens": statistics.median(
                        int(r.headers.get("x-inferscale-injected-tokens", 0)) for r in results),
                    "computed_tokens": computed_tokens(pairs),
                    # K/V rows (a token of a layer) not written: before a sliding window
                    "window_skipped_rows": _delta(pairs, "inferscale_kv_window_skipped_rows_total")
                    / len(pairs),
                    # durable page-ins per request: content hashed, or a file version hashed
                    # before (by this server)
                    "page_in_checks": {check: _delta(pairs, "inferscale_kv_page_in_checks_total",
                                                     check=check) / len(pairs)
                                       for check in ("hashed", "known_version")},
                    "wall_ms_per_request": wall_ms, "processes": cpu,
                    "recompute_auto": auto_costs(
                        [r.headers.get("x-inferscale-recompute-auto") for r in results], ttfts),
                    "retrieval_ms": statistics.median(
                        float(r.headers.get("x-inferscale-retrieval-ms", 0)) for r in results),
                    "stages_ms": {label: _delta(pairs, metric, **({"stage": stage} if stage
                                                                  else {})) * 1000 / len(pairs)
                                  for label, metric, stage in STAGES},
                })
                print(f"k={k:>2} {mode:>10}: median TTFT {rows[-1]['ttft_median_s']:.3f}s",
                      flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """TTFT median vs k, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in (*MODES, DISK_MODE):
        points = [(r["k"], r["ttft_median_s"]) for r in rows if r["mode"] == mode]
        ax.plot(*zip(*points, strict=True), marker="o", label=mode)
    ax.set_xlabel("k (facts retrieved)")
    ax.set_ylabel("median TTFT over HTTP (s)")
    ax.set_yscale("log")
    ax.set_title("InferScale TTFT vs k (SmolLM2-135M, CPU)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def prepare_user(settings: Settings, data: Path, turns_limit: int
                 ) -> tuple[Settings, str, list[str], list]:
    """Stack ready; the first conversation of ``data`` as a fresh bench user; its questions."""
    settings = prepare(settings)
    sample = json.loads(data.read_text())[0]
    user = f"bench-{sample['sample_id']}-{uuid.uuid4().hex[:6]}"
    turns = [t.model_copy(update={"user_id": user, "conversation_id": user})
             for t in read_turns(data) if t.user_id == sample["sample_id"]][:turns_limit]
    questions = [q["question"] for q in sample["qa"] if q.get("category") != 5]
    return settings, user, questions, turns


def ingest_user(settings: Settings, user: str, turns: list) -> float:
    """Publish the user's turns and wait until every fact is encoded (a worker must run)."""

    async def go() -> float:
        bootstrap, security = resolve_kafka_bootstrap(settings), kafka_security(settings)
        await ensure_topics(bootstrap, [settings.turns_topic, settings.dead_letter_topic],
                            security=security)
        await publish_turns(bootstrap, settings.turns_topic, turns, security=security)
        engine = create_engine(settings.database_url)
        try:
            return await wait_encoded(engine, user, len(turns), settings)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def encoded_user(settings: Settings, data: Path, out_dir: Path, turns_limit: int
                 ) -> tuple[Settings, str, list[str], list, float]:
    """``prepare_user``, then its turns ingested and encoded by a worker alone (no server yet):
    the ready settings, user, questions, turns and the seconds encoding took."""
    settings, user, questions, turns = prepare_user(settings, data, turns_limit)
    out_dir.mkdir(parents=True, exist_ok=True)
    with worker_process(settings, out_dir / "worker.log", sharing=1):
        encode_s = ingest_user(settings, user, turns)
    print(f"{len(turns)} facts ingested and encoded in {encode_s:.0f}s")
    return settings, user, questions, turns, encode_s


def run(settings: Settings, data: Path, out_dir: Path, n_queries: int = 20,
        ks: tuple[int, ...] = (0, 5, 10, 20, 50), turns_limit: int = 150) -> dict:
    """Ingest one LoCoMo conversation through the real pipeline, serve it, measure TTFT."""
    settings, user, questions, turns, encode_s = encoded_user(settings, data, out_dir,
                                                              turns_limit)
    questions = questions[:n_queries]
    with server_process(settings, out_dir / "server.log") as url:
        rows = asyncio.run(measure(url, user, questions, list(ks)))
    # The disk tier: a second server whose host and device tiers hold nothing.
    diskless = settings.model_copy(update={"host_cache_bytes": 0, "device_cache_bytes": 0})
    with server_process(diskless, out_dir / "server-disk.log") as url:
        rows += asyncio.run(measure(url, user, questions, list(ks), (DISK_MODE,)))
    table, breakdown = [], []
    for k in ks:
        by = {r["mode"]: r for r in rows if r["k"] == k}
        inject, disk, hit = by["inject"], by[DISK_MODE], by["prefix-hit"]
        auto = inject["recompute_auto"] or {}
        table.append([k, by["none"]["ttft_median_s"], by["text"]["ttft_median_s"],
                      hit["ttft_median_s"], inject["ttft_median_s"],
                      by["inject-m0"]["ttft_median_s"], by["inject-m2"]["ttft_median_s"],
                      disk["ttft_median_s"],
                      by["text"]["ttft_median_s"] / inject["ttft_median_s"],
                      inject["ttft_median_s"] / hit["ttft_median_s"],
                      by["inject-m0"]["ttft_median_s"] / hit["ttft_median_s"],
                      by["inject-m2"]["ttft_median_s"] / hit["ttft_median_s"],
                      disk["ttft_median_s"] / hit["ttft_median_s"],
                      auto.get("recomputed_share", ""), auto.get("text_share", ""),
                      auto.get("ttft_recomputed_p50_s") or "",
                      auto.get("ttft_recomputed_p99_s") or "",
                      int(by["text"]["prompt_tokens"]), int(inject["injected_tokens"]),
                      round(hit["computed_tokens"]), round(inject["computed_tokens"])])
        for row in (inject, disk):
            breakdown.append([k, row["mode"], *row["stages_ms"].values(),
                              *row["page_in_checks"].values(),
                              row["engine_ttft_mean_s"] * 1000, hit["engine_ttft_mean_s"] * 1000])
    print_table(["k", "none p50", "text p50", "prefix-hit p50", "inject p50", "m=0 p50",
                 "m=2 p50", "inject-disk p50", "text/inject", "inject/hit", "m=0/hit",
                 "m=2/hit", "disk/hit", "auto: recomputed", "auto: text", "recomputed p50",
                 "recomputed p99",
                 "prompt tok", "injected tok", "computed tok hit", "computed tok inject"], table)
    print("host ms per request by stage, page-ins hashed / of known versions per request, and "
          "vLLM's mean engine TTFT (ms):")
    print_table(["k", "mode", *(label for label, _, _ in STAGES), "hashed", "known version",
                 "engine TTFT",
                 "engine TTFT prefix-hit"], breakdown)
    print(f"per request at k = {max(ks)}: wall ms, then CPU / run-queue wait ms by process:")
    for row in rows:
        if row["k"] == max(ks):
            print(f"  {row['mode']:>11}: {row['wall_ms_per_request']:6.1f}  " + ", ".join(
                f"{name} {t['cpu_ms']:.1f}/{t['runqueue_wait_ms']:.1f}"
                for name, t in row["processes"].items()))
    report = {"n_queries": len(questions), "facts": len(turns), "encode_s": encode_s,
              "durable_tier": settings.kv_url or str(settings.kv_path), "rows": rows}
    write_report(out_dir, "ttft", report)
    plot(rows, out_dir / "ttft.png")
    return report
