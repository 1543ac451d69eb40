"""The roads in, side by side in one run on the real server at the defaults: a memory chat
completion, the same request on the Responses API, and the chat again with its exchange
recorded (``"record": true``), each question of one LoCoMo conversation (whole) asked on every
arm in turn, with a fresh cache salt (every fact injected, nothing from vLLM's prefix cache).
Reported per arm: TTFT and whole-answer latency (medians with intervals), and the paired
ratios responses / chat (TTFT) and recorded / chat (whole answer: what recording adds).
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import httpx

from inferscale.core.settings import Settings
from inferscale.devstack.chat_client import stream_chat
from inferscale.devstack.stack import server_process
from inferscale.lab.bench.common import print_table, settings_differing, write_report
from inferscale.lab.bench.soak_timeline import median_ci
from inferscale.lab.bench.ttft import encoded_user

ARMS = {"chat": ("chat", None), "responses": ("responses", None),
        "chat-recorded": ("chat", {"record": True})}
MAX_TOKENS = 16


async def measure(url: str, owner: str, questions: list[str], k: int
                  ) -> dict[str, list[dict[str, float]]]:
    """Per arm, TTFT and whole-answer seconds of each question (two warm-up questions per arm
    first, not counted)."""
    records: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    async with httpx.AsyncClient(timeout=300) as client:
        for question in questions[-2:]:
            for route, options in ARMS.values():
                await stream_chat(client, url, owner, question, "inject", k,
                                  max_tokens=MAX_TOKENS, options=options, route=route)
        for i, question in enumerate(questions):
            for arm, (route, options) in ARMS.items():
                result = await stream_chat(client, url, owner, question, "inject", k,
                                           max_tokens=MAX_TOKENS, options=options,
                                           route=route)
                records[arm].append({"ttft_s": result.ttft, "total_s": result.total})
            if i % 25 == 0:
                print(f"question {i + 1}/{len(questions)}: " + ", ".join(
                    f"{arm} {records[arm][-1]['ttft_s']:.3f}s" for arm in ARMS), flush=True)
    return records


def _paired(top: list[dict[str, float]], bottom: list[dict[str, float]], field: str) -> dict:
    ratios = [t[field] / b[field] for t, b in zip(top, bottom, strict=True)]
    return {"p50": statistics.median(ratios), "ci": median_ci(ratios), "n": len(ratios)}


def summarize(records: dict[str, list[dict[str, float]]]) -> dict:
    out: dict = {arm: {field: {"p50": statistics.median(r[field] for r in rows),
                               "ci": median_ci([r[field] for r in rows]), "n": len(rows)}
                       for field in ("ttft_s", "total_s")} for arm, rows in records.items()}
    out["responses_over_chat_ttft"] = _paired(records["responses"], records["chat"], "ttft_s")
    out["recorded_over_chat_total"] = _paired(records["chat-recorded"], records["chat"],
                                              "total_s")
    return out


def run(settings: Settings, data: Path, out_dir: Path, k: int | None = None) -> dict:
    """Ingest the first conversation of ``data`` whole, serve it, measure (module doc)."""
    k = k or settings.top_k
    settings, owner, questions, turns, encode_s = encoded_user(settings, data, out_dir,
                                                               100_000)
    with server_process(settings, out_dir / "server.log") as url:
        records = asyncio.run(measure(url, owner, questions, k))
    summary = summarize(records)
    print_table(["arm", "n", "TTFT p50 s", "TTFT p50 CI", "answer p50 s", "answer p50 CI"],
                [[arm, s["ttft_s"]["n"], s["ttft_s"]["p50"], s["ttft_s"]["ci"],
                  s["total_s"]["p50"], s["total_s"]["ci"]]
                 for arm, s in summary.items() if arm in ARMS])
    for name in ("responses_over_chat_ttft", "recorded_over_chat_total"):
        print(f"{name}: paired p50 {summary[name]['p50']:.3f} {summary[name]['ci']}")
    report = {"settings_differing": settings_differing(settings),
              "data": {"file": str(data), "conversation": 0, "turns": len(turns),
                       "questions": len(questions), "whole_conversation": True},
              "k": k, "max_tokens": MAX_TOKENS, "encode_s": encode_s, "summary": summary,
              "records": records}
    write_report(out_dir, "routes", report)
    return report
