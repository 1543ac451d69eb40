"""Pinned facts against retrieved ones, over HTTP on the real server, at the defaults.

One LoCoMo conversation, whole, as two owners with the same facts: on one, ``p`` facts are
pinned (the conversation's first ``p``: in every prompt, first, in id order) and ``k`` are
retrieved; on the other, ``k + p`` are retrieved. Every question of the conversation is asked
in order as a session (no client salt: an owner's requests share vLLM's prefix cache where the
server's salts allow), of both owners in turn, and each prompt again as text prefill with a
fresh salt (nothing cached). Reported: TTFT of each (medians with intervals, the paired ratio),
the pinned owner's first request (its pinned facts not yet cached), first-token agreement with
text prefill of the same prompt (Wilson intervals), and the prompt tokens vLLM computed, read
from its prefix cache and got injected per request.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import httpx

from inferscale.client import AsyncMemoryClient
from inferscale.core.settings import Settings
from inferscale.devstack.chat_client import ChatResult, scrape, stream_chat, totals
from inferscale.devstack.stack import server_process, worker_process
from inferscale.lab.bench.common import print_table, settings_differing, write_report
from inferscale.lab.bench.soak_timeline import median_ci
from inferscale.lab.bench.ttft import ingest_user, prepare_user
from inferscale.lab.fidelity import wilson_interval

ARMS = ("pinned", "retrieved", "pinned-text", "retrieved-text")
COUNTERS = {"prompt": "vllm:prompt_tokens_total", "cached": "vllm:prefix_cache_hits_total",
            "injected": "inferscale_kv_injected_tokens_total"}
ENCODED_TIMEOUT_S = 600.0


async def _pin(url: str, owner: str, p: int) -> list[int]:
    """Pin the owner's first ``p`` facts (edits: new versions) and wait until they are
    encoded; their new ids."""
    async with AsyncMemoryClient(url) as memory:
        first = (await memory.list_facts(owner, limit=p))["facts"]
        pinned = [(await memory.edit_fact(owner, f["id"], pinned=True)).id for f in first]
        deadline = time.monotonic() + ENCODED_TIMEOUT_S
        while not all([(await memory.get_fact(owner, i)).kv.encoded for i in pinned]):
            if time.monotonic() > deadline:
                raise TimeoutError("the pinned facts were not encoded in time")
            await asyncio.sleep(1.0)
    return pinned


async def _ask(client: httpx.AsyncClient, url: str, owner: str, question: str, mode: str,
               k: int, fresh: bool) -> tuple[ChatResult, dict[str, float]]:
    """One timed request (first token's id kept) and the engine's token counters it moved
    (every attempt of recompute auto included)."""
    before = await scrape(client, url)
    result = await stream_chat(client, url, owner, question, mode, k, max_tokens=4,
                               fresh=fresh, top_logprobs=1)
    after = await scrape(client, url)
    return result, {name: totals(after, metric) - totals(before, metric)
                    for name, metric in COUNTERS.items()}


async def measure(url: str, owners: dict[str, str], questions: list[str], k: int, p: int
                  ) -> dict[str, list[dict]]:
    """Per arm, one record per question: TTFT, first token, recompute auto's outcome and the
    token counters. Warm-up requests (two questions per arm) carry their own salts, so the
    pinned owner's session starts cold."""
    plan = {"pinned": (owners["pinned"], "inject", k, False),
            "retrieved": (owners["retrieved"], "inject", k + p, False),
            "pinned-text": (owners["pinned"], "text", k, True),
            "retrieved-text": (owners["retrieved"], "text", k + p, True)}
    records: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    async with httpx.AsyncClient(timeout=300) as client:
        for question in questions[-2:]:
            for owner, mode, n, _ in plan.values():
                await stream_chat(client, url, owner, question, mode, n, max_tokens=4)
        for i, question in enumerate(questions):
            for arm in ARMS:
                owner, mode, n, fresh = plan[arm]
                result, counts = await _ask(client, url, owner, question, mode, n, fresh)
                records[arm].append({
                    "ttft_s": result.ttft, "first": result.token_ids[:1],
                    "auto": result.headers.get("x-inferscale-recompute-auto"),
                    "facts": int(result.headers.get("x-inferscale-facts", 0)),
                    "pinned": int(result.headers.get("x-inferscale-facts-pinned", 0)),
                    **counts})
            if i % 20 == 0:
                print(f"question {i + 1}/{len(questions)}: " + ", ".join(
                    f"{arm} {records[arm][-1]['ttft_s']:.3f}s" for arm in ARMS), flush=True)
    return records


def summarize(records: dict[str, list[dict]]) -> dict:
    """Medians with intervals, paired ratios and agreement rates; the first (cold) request of
    the pinned owner apart."""
    out: dict = {}
    for arm, rows in records.items():
        ttfts = [r["ttft_s"] for r in rows[1:]]  # the session's first request apart
        out[arm] = {"n": len(ttfts), "ttft_p50_s": statistics.median(ttfts),
                    "ttft_p50_ci": median_ci(ttfts),
                    "ttft_first_request_s": rows[0]["ttft_s"],
                    **{f"{name}_tokens_mean": statistics.mean(r[name] for r in rows[1:])
                       for name in COUNTERS},
                    "auto": {o: sum(r["auto"] == o for r in rows[1:]) / len(ttfts)
                             for o in ("kept", "recomputed", "text")}}
    for arm in ("pinned", "retrieved"):
        pairs = list(zip(records[arm], records[f"{arm}-text"], strict=True))
        agree = sum(a["first"] == t["first"] for a, t in pairs)
        out[arm]["first_token_agreement"] = agree / len(pairs)
        out[arm]["first_token_agreement_ci"] = wilson_interval(agree, len(pairs))
        ratios = [t["ttft_s"] / a["ttft_s"] for a, t in pairs[1:]]
        out[arm]["text_over_memory_p50"] = statistics.median(ratios)
        out[arm]["text_over_memory_ci"] = median_ci(ratios)
    ratios = [r["ttft_s"] / p["ttft_s"]
              for p, r in zip(records["pinned"][1:], records["retrieved"][1:], strict=True)]
    out["retrieved_over_pinned_p50"] = statistics.median(ratios)
    out["retrieved_over_pinned_ci"] = median_ci(ratios)
    return out


def run(settings: Settings, data: Path, out_dir: Path, k: int = 5, p: int = 5) -> dict:
    """Ingest the first conversation of ``data`` whole as two owners, pin ``p`` facts of one,
    measure (module doc)."""
    settings, owner, questions, turns = prepare_user(settings, data, turns_limit=100_000)
    twin = f"{owner}-pinned"
    twin_turns = [t.model_copy(update={"user_id": twin, "conversation_id": twin})
                  for t in turns]
    out_dir.mkdir(parents=True, exist_ok=True)
    with worker_process(settings, out_dir / "worker.log", sharing=1):
        encode_s = ingest_user(settings, owner, turns) + ingest_user(settings, twin, twin_turns)
    with (worker_process(settings, out_dir / "worker.log"),
          server_process(settings, out_dir / "server.log") as url):
        pinned = asyncio.run(_pin(url, twin, p))
    with server_process(settings, out_dir / "server.log") as url:
        records = asyncio.run(measure(url, {"pinned": twin, "retrieved": owner}, questions,
                                      k, p))
    summary = summarize(records)
    print_table(["arm", "n", "TTFT p50 s", "first request s", "text / memory p50",
                 "first token = text", "computed tok", "cached tok", "injected tok"],
                [[arm, summary[arm]["n"], summary[arm]["ttft_p50_s"],
                  summary[arm]["ttft_first_request_s"],
                  summary[arm].get("text_over_memory_p50", ""),
                  summary[arm].get("first_token_agreement", ""),
                  summary[arm]["prompt_tokens_mean"] - summary[arm]["cached_tokens_mean"]
                  - summary[arm]["injected_tokens_mean"],
                  summary[arm]["cached_tokens_mean"], summary[arm]["injected_tokens_mean"]]
                 for arm in ARMS])
    print(f"retrieved (k + p = {k + p}) over pinned (p = {p} + k = {k}) TTFT, paired p50: "
          f"{summary['retrieved_over_pinned_p50']:.2f} {summary['retrieved_over_pinned_ci']}")
    report = {"settings_differing": settings_differing(settings),
              "data": {"file": str(data), "conversation": 0, "turns": len(turns),
                       "questions": len(questions), "whole_conversation": True},
              "k": k, "p": p, "pinned_fact_ids": pinned, "encode_s": encode_s,
              "summary": summary, "records": records}
    write_report(out_dir, "pinned", report)
    return report
