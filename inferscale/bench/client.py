"""OpenAI-API client helpers for benchmarks: streamed chat with TTFT, vLLM metric scraping."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import httpx


@dataclass
class ChatResult:
    """One streamed answer and its timings (seconds)."""

    ttft: float
    total: float
    text: str
    headers: dict[str, str]


async def stream_chat(client: httpx.AsyncClient, url: str, user: str, question: str, mode: str,
                      k: int, max_tokens: int = 16, fresh: bool = True) -> ChatResult:
    """Send one memory chat request with ``stream: true``; TTFT = first content token."""
    body = {"model": "inferscale", "user": user, "stream": True, "max_tokens": max_tokens,
            "temperature": 0, "messages": [{"role": "user", "content": question}],
            "inferscale": {"mode": mode, "k": k}}
    if fresh:  # no reuse of earlier requests' prefix cache: every request prefills (or injects)
        body["cache_salt"] = uuid.uuid4().hex
    started = time.perf_counter()
    ttft = None
    parts: list[str] = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and ttft is None:
                ttft = time.perf_counter() - started
            parts.append(delta)
        headers = {k: v for k, v in response.headers.items() if k.startswith("x-inferscale")}
    total = time.perf_counter() - started
    return ChatResult(ttft=ttft if ttft is not None else total, total=total,
                      text="".join(parts), headers=headers)


async def engine_ttft_totals(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """(sum, count) of vLLM's own time-to-first-token histogram."""
    text = (await client.get(f"{url}/metrics")).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:time_to_first_token_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:time_to_first_token_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count
