"""TTFT vs k: inject vs text prefill vs no memory, same facts and order, over HTTP."""

from __future__ import annotations

import asyncio
import json
import statistics
import uuid
from pathlib import Path

import httpx

from inferscale.bench.client import engine_ttft_totals, stream_chat
from inferscale.bench.common import percentile, print_table, write_report
from inferscale.db.engine import create_engine
from inferscale.kafka import ensure_topics, publish_turns
from inferscale.settings import Settings
from inferscale.sources import read_turns
from inferscale.stack import prepare, server_process, wait_encoded, worker_process

MODES = ("inject", "text", "none")


async def measure(url: str, user: str, questions: list[str], ks: list[int]) -> list[dict]:
    """Per (k, mode): median/p90 of HTTP TTFT and vLLM's mean engine TTFT."""
    rows = []
    async with httpx.AsyncClient(timeout=300) as client:
        for question in questions[:2]:  # warm-up: compile paths, load caches
            for mode in MODES:
                await stream_chat(client, url, user, question, mode, max(ks), fresh=True)
        for k in ks:
            for mode in MODES:
                before = await engine_ttft_totals(client, url)
                results = [await stream_chat(client, url, user, q, mode, k) for q in questions]
                after = await engine_ttft_totals(client, url)
                ttfts = [r.ttft for r in results]
                rows.append({
                    "k": k, "mode": mode, "n": len(results),
                    "ttft_median_s": statistics.median(ttfts), "ttft_p90_s": percentile(ttfts, 90),
                    "engine_ttft_mean_s": (after[0] - before[0]) / max(1, after[1] - before[1]),
                    "prompt_tokens": statistics.median(
                        int(r.headers.get("x-inferscale-prompt-tokens", 0)) for r in results),
                    "injected_tokens": statistics.median(
                        int(r.headers.get("x-inferscale-injected-tokens", 0)) for r in results),
                    "retrieval_ms": statistics.median(
                        float(r.headers.get("x-inferscale-retrieval-ms", 0)) for r in results),
                })
                print(f"k={k:>2} {mode:>6}: median TTFT {rows[-1]['ttft_median_s']:.3f}s",
                      flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """TTFT median vs k, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        points = [(r["k"], r["ttft_median_s"]) for r in rows if r["mode"] == mode]
        ax.plot(*zip(*points, strict=True), marker="o", label=mode)
    ax.set_xlabel("k (facts retrieved)")
    ax.set_ylabel("median TTFT over HTTP (s)")
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
        await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic,
                                                       settings.dead_letter_topic])
        await publish_turns(settings.kafka_bootstrap, settings.turns_topic, turns)
        engine = create_engine(settings.database_url)
        try:
            return await wait_encoded(engine, user, len(turns))
        finally:
            await engine.dispose()

    return asyncio.run(go())


def run(settings: Settings, data: Path, out_dir: Path, n_queries: int = 20,
        ks: tuple[int, ...] = (0, 5, 10, 20, 50), turns_limit: int = 150) -> dict:
    """Ingest one LoCoMo conversation through the real pipeline, serve it, measure TTFT."""
    settings, user, questions, turns = prepare_user(settings, data, turns_limit)
    questions = questions[:n_queries]
    out_dir.mkdir(parents=True, exist_ok=True)
    with worker_process(settings, out_dir / "worker.log"):
        encode_s = ingest_user(settings, user, turns)
    print(f"{len(turns)} facts ingested and encoded in {encode_s:.0f}s; starting the server")
    with server_process(settings, out_dir / "server.log") as url:
        rows = asyncio.run(measure(url, user, questions, list(ks)))
    table = []
    for k in ks:
        by = {r["mode"]: r for r in rows if r["k"] == k}
        table.append([k, by["none"]["ttft_median_s"], by["text"]["ttft_median_s"],
                      by["inject"]["ttft_median_s"],
                      by["text"]["ttft_median_s"] / by["inject"]["ttft_median_s"],
                      by["text"]["engine_ttft_mean_s"] / by["inject"]["engine_ttft_mean_s"],
                      int(by["text"]["prompt_tokens"]), int(by["inject"]["injected_tokens"]),
                      by["inject"]["ttft_p90_s"], by["text"]["ttft_p90_s"]])
    print_table(["k", "none p50", "text p50", "inject p50", "text/inject", "engine ratio",
                 "prompt tok", "injected tok", "inject p90", "text p90"], table)
    report = {"n_queries": len(questions), "facts": len(turns), "encode_s": encode_s,
              "rows": rows}
    write_report(out_dir, "ttft", report)
    plot(rows, out_dir / "ttft.png")
    return report
