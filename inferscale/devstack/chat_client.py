"""OpenAI-API client helpers for benchmarks: streamed chat with TTFT, vLLM metric scraping."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from inferscale.core.local_key import key_for


@dataclass
class ChatResult:
    """One streamed answer and its timings (seconds)."""

    ttft: float
    total: float
    text: str
    headers: dict[str, str]
    token_ids: list[int] = field(default_factory=list)  # generated ids (with top_logprobs)
    first_top: dict[int, float] = field(default_factory=dict)  # first position: id -> logprob


async def _stream_response(client: httpx.AsyncClient, url: str, user: str, question: str,
                           mode: str, k: int, max_tokens: int, options: dict | None,
                           salt: str) -> ChatResult:
    """``stream_chat`` on ``/v1/responses``: TTFT = the first text delta event."""
    body = {"model": "inferscale", "user": user, "stream": True, "input": question,
            "max_output_tokens": max_tokens, "temperature": 0, "cache_salt": salt,
            "inferscale": {"mode": mode, "k": k, **(options or {})}}
    started = time.perf_counter()
    ttft, parts, headers = None, [], dict[str, str]()
    async for event in _events(client, url, "/v1/responses", body, headers):
        if event.get("type") == "response.output_text.delta":
            if ttft is None:
                ttft = time.perf_counter() - started
            parts.append(event.get("delta") or "")
    total = time.perf_counter() - started
    return ChatResult(ttft=ttft if ttft is not None else total, total=total,
                      text="".join(parts), headers=headers)


async def _events(client: httpx.AsyncClient, url: str, path: str, body: dict,
                  headers: dict[str, str]) -> AsyncIterator[dict]:
    """The JSON events of one streamed request (``headers`` gets its ``x-inferscale-*``
    headers). A client without an ``Authorization`` header sends this machine's key."""
    key = None if "authorization" in client.headers else key_for(url)
    async with client.stream("POST", f"{url}{path}", json=body,
                             headers={"authorization": f"Bearer {key}"} if key else None
                             ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        headers.update({k: v for k, v in response.headers.items()
                        if k.startswith("x-inferscale")})
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


async def stream_chat(client: httpx.AsyncClient, url: str, user: str, question: str, mode: str,
                      k: int, max_tokens: int = 16, fresh: bool = True,
                      options: dict | None = None, top_logprobs: int = 0,
                      salt: str | None = None, route: str = "chat") -> ChatResult:
    """Send one memory chat request with ``stream: true``; TTFT = first generated token. A
    client without an ``Authorization`` header sends this machine's key (``key_for``).
    ``options`` adds memory options (recompute, order); ``top_logprobs`` > 0 also returns the
    generated token ids and the first position's top logprobs; ``salt`` shares prefix-cache
    blocks with the requests that carry the same one. ``route="responses"`` asks the same of
    ``/v1/responses`` (text only: no logprobs)."""
    if route == "responses":
        return await _stream_response(client, url, user, question, mode, k, max_tokens,
                                      options, salt or uuid.uuid4().hex)
    body = {"model": "inferscale", "user": user, "stream": True, "max_tokens": max_tokens,
            "temperature": 0, "messages": [{"role": "user", "content": question}],
            "inferscale": {"mode": mode, "k": k, **(options or {})}}
    if top_logprobs:
        body.update(logprobs=True, top_logprobs=top_logprobs, return_tokens_as_token_ids=True)
    if salt is not None or fresh:  # fresh: no reuse of earlier requests' prefix cache
        body["cache_salt"] = salt or uuid.uuid4().hex
    started = time.perf_counter()
    ttft = None
    parts: list[str] = []
    result = ChatResult(ttft=0.0, total=0.0, text="", headers={})
    headers: dict[str, str] = {}
    async for event in _events(client, url, "/v1/chat/completions", body, headers):
        choice = event["choices"][0]
        delta = choice["delta"].get("content") or ""
        tokens = (choice.get("logprobs") or {}).get("content") or []
        if (delta or tokens) and ttft is None:
            ttft = time.perf_counter() - started
        for item in tokens:
            if not result.token_ids:
                result.first_top = {_token_id(t["token"]): t["logprob"]
                                    for t in item["top_logprobs"]}
            result.token_ids.append(_token_id(item["token"]))
        parts.append(delta)
    result.total = time.perf_counter() - started
    result.ttft = ttft if ttft is not None else result.total
    result.text, result.headers = "".join(parts), headers
    return result


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus exposition text as samples keyed by (name, sorted labels)."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


async def scrape(client: httpx.AsyncClient, url: str) -> dict[tuple[str, tuple], float]:
    """The server's /metrics samples."""
    return parse_metrics((await client.get(f"{url}/metrics")).text)


def totals(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (over the rest)."""
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and set(labels.items()) <= set(sample_labels))
