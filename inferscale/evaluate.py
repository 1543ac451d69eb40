"""`inferscale eval locomo`: answer accuracy with memory injected vs prefilled vs none.

Each conversation is ingested through the real pipeline (Kafka -> worker process -> Postgres and
KV store) once per encoding window w; then QA categories 1-4 are answered through the server
with inject (per w and k), text (per k; the same facts, in the same order, prefilled) and none.
Scores: LoCoMo token F1 and exact match by category, first-token agreement inject vs text.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import uuid
from collections import defaultdict
from pathlib import Path

import httpx

from inferscale.bench.common import print_table, write_report
from inferscale.db.engine import create_engine
from inferscale.kafka import ensure_topics, publish_turns
from inferscale.scoring import exact_match, locomo_f1
from inferscale.settings import Settings
from inferscale.sources import locomo_turns
from inferscale.stack import prepare, server_process, wait_encoded, worker_process


def _ingest(settings: Settings, samples: list[dict], window: int, out_dir: Path) -> dict:
    """Ingest every sample under window-specific user ids; returns sample_id -> user id."""
    tag = uuid.uuid4().hex[:6]
    run = settings.model_copy(update={
        "window": window, "turns_topic": f"eval-{tag}", "dead_letter_topic": f"eval-{tag}.dlq",
        "consumer_group": f"eval-{tag}"})
    users = {s["sample_id"]: f"{s['sample_id']}-w{window}-{tag}" for s in samples}
    events = [t.model_copy(update={"user_id": users[t.user_id],
                                   "conversation_id": users[t.user_id]})
              for t in locomo_turns(samples)]

    async def go() -> None:
        await ensure_topics(run.kafka_bootstrap, [run.turns_topic, run.dead_letter_topic])
        await publish_turns(run.kafka_bootstrap, run.turns_topic, events)
        engine = create_engine(run.database_url)
        try:
            for user in users.values():
                await wait_encoded(engine, user, sum(e.user_id == user for e in events))
        finally:
            await engine.dispose()

    with worker_process(run, out_dir / f"worker-w{window}.log"):
        asyncio.run(go())
    return users


async def _answer(client: httpx.AsyncClient, url: str, user: str, question: str, mode: str,
                  k: int) -> str:
    response = await client.post(f"{url}/v1/chat/completions", json={
        "model": "inferscale", "user": user, "max_tokens": 32, "temperature": 0,
        "messages": [{"role": "user", "content": question}],
        "inferscale": {"mode": mode, "k": k}})
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"] or ""


async def _ask_all(url: str, items: list[dict], ks: list[int], windows: list[int]) -> list[dict]:
    records = []
    async with httpx.AsyncClient(timeout=300) as client:
        for n, item in enumerate(items, 1):
            base = {"question": item["question"], "answer": item["answer"],
                    "category": item["category"]}
            user0 = item["users"][windows[0]]
            records.append({**base, "mode": "none", "k": 0, "w": None, "prediction":
                            await _answer(client, url, user0, item["question"], "none", 0)})
            for k in ks:
                records.append({**base, "mode": "text", "k": k, "w": None, "prediction":
                                await _answer(client, url, user0, item["question"], "text", k)})
                for w in windows:
                    records.append({**base, "mode": "inject", "k": k, "w": w, "prediction":
                                    await _answer(client, url, item["users"][w],
                                                  item["question"], "inject", k)})
            print(f"  answered {n}/{len(items)}", flush=True)
    for r in records:
        r["f1"] = locomo_f1(r["prediction"], r["answer"], r["category"])
        r["em"] = exact_match(r["prediction"], r["answer"])
    return records


def _first_token(text: str) -> str:
    return (text.split() or [""])[0].lower()


def summarize(records: list[dict], ks: list[int], windows: list[int]) -> dict:
    """F1/EM by configuration and category; first-token agreement and gap inject - text."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        name = r["mode"] if r["mode"] == "none" else (
            f"text k={r['k']}" if r["mode"] == "text" else f"inject k={r['k']} w={r['w']}")
        groups[name].append(r)
    categories = sorted({r["category"] for r in records})
    summary = {}
    for name, rows in groups.items():
        summary[name] = {
            "f1": statistics.mean(r["f1"] for r in rows),
            "em": statistics.mean(r["em"] for r in rows),
            "by_category": {c: statistics.mean(r["f1"] for r in rows if r["category"] == c)
                            for c in categories if any(r["category"] == c for r in rows)},
        }
    agreement = {}
    for k in ks:
        text = {r["question"]: r["prediction"] for r in groups[f"text k={k}"]}
        for w in windows:
            rows = groups[f"inject k={k} w={w}"]
            agreement[f"k={k} w={w}"] = {
                "first_token_agreement": statistics.mean(
                    _first_token(r["prediction"]) == _first_token(text[r["question"]])
                    for r in rows),
                "f1_gap_inject_minus_text": summary[f"inject k={k} w={w}"]["f1"]
                - summary[f"text k={k}"]["f1"]}
    return {"configs": summary, "agreement": agreement, "categories": categories}


def run(settings: Settings, data: Path, out_dir: Path, conversations: int = 1,
        questions: int = 25, ks: tuple[int, ...] = (5, 20), windows: tuple[int, ...] = (0, 5),
        seed: int = 0) -> dict:
    """Ingest, serve, answer and score; prints a table and writes JSON."""
    samples = json.loads(data.read_text())[:conversations]
    settings = prepare(settings)
    out_dir.mkdir(parents=True, exist_ok=True)
    users_by_window = {w: _ingest(settings, samples, w, out_dir) for w in windows}
    rng = random.Random(seed)
    items = []
    for sample in samples:
        qa = [q for q in sample["qa"] if q.get("category") in (1, 2, 3, 4) and "answer" in q]
        for q in rng.sample(qa, min(questions, len(qa))):
            items.append({**q, "users": {w: users_by_window[w][sample["sample_id"]]
                                         for w in windows}})
    with server_process(settings, out_dir / "server.log") as url:
        records = asyncio.run(_ask_all(url, items, list(ks), list(windows)))
    summary = summarize(records, list(ks), list(windows))
    cats = summary["categories"]
    print_table(["config", "F1", "EM", *[f"F1 cat {c}" for c in cats]],
                [[name, s["f1"], s["em"], *[s["by_category"].get(c, float("nan")) for c in cats]]
                 for name, s in sorted(summary["configs"].items())])
    print_table(["inject vs text", "first-token agreement", "F1 gap inject - text"],
                [[name, a["first_token_agreement"], a["f1_gap_inject_minus_text"]]
                 for name, a in summary["agreement"].items()])
    report = {"data": str(data), "questions": len(items), "ks": list(ks),
              "windows": list(windows), "summary": summary, "records": records}
    write_report(out_dir, "eval-locomo", report)
    return report
