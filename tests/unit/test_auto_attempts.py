"""Recompute auto's attempts through the front end (pure logic over ASGI, a fake engine): one
attempt answers, whole: the first where its first token is sure, else the tail-recomputed one,
else (a tie there too) every fact as text; the client gets that attempt's bytes only, the
headers of the attempts that decided, and one count of the outcome."""

import asyncio
import json

import pytest
from prometheus_client import REGISTRY

from inferscale.serving.asgi import Downstream
from inferscale.serving.auto_recompute import AutoRecompute
from inferscale.serving.frontend import MemoryFrontend, _Rewritten

SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}


def _engine(margins: dict[str, float]):
    """An OpenAI-style streaming engine: each request names its attempt; the first token's
    top-2 margin is the attempt's."""
    async def app(scope, receive, send):
        attempt = json.loads((await receive())["body"])["attempt"]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for token in ("one ", "two"):
            top = [{"token": "x", "logprob": -0.1},
                   {"token": "y", "logprob": -0.1 - margins[attempt]}]
            chunk = {"choices": [{"index": 0, "delta": {"content": f"{attempt}:{token}"},
                                  "logprobs": {"content": [{"token": token, "logprob": -0.1,
                                                            "top_logprobs": top}]}}]}
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + json.dumps(chunk).encode() + b"\n\n"})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})
    return app


def _count(outcome: str) -> float:
    return REGISTRY.get_sample_value("inferscale_recompute_auto_total",
                                     {"decision": outcome}) or 0.0


@pytest.mark.parametrize(("margins", "text_threshold", "outcome", "margin_headers"), [
    ({"kept": 0.9}, 0.125, "kept", {"x-inferscale-first-margin": "0.900"}),
    # under the direct threshold (0.1): the tail is skipped, every fact as text at once
    ({"kept": 0.05, "text": 0.0}, 0.125, "text", {"x-inferscale-first-margin": "0.050"}),
    ({"kept": 0.1, "recomputed": 0.5}, 0.125, "recomputed",
     {"x-inferscale-first-margin": "0.100", "x-inferscale-tail-margin": "0.500"}),
    ({"kept": 0.1, "recomputed": 0.0, "text": 0.0}, 0.125, "text",
     {"x-inferscale-first-margin": "0.100", "x-inferscale-tail-margin": "0.000"}),
    ({"kept": 0.1, "recomputed": 0.0}, 0.0, "recomputed", {"x-inferscale-first-margin": "0.100"}),
])
async def test_one_attempt_answers_whole_with_the_headers_that_decided(
        margins, text_threshold, outcome, margin_headers):
    frontend = MemoryFrontend(_engine(margins))
    asked = []

    async def retry(tail_only: bool, gated: bool) -> tuple[bytes, dict[str, str]]:
        attempt = "recomputed" if tail_only else "text"
        asked.append((attempt, gated))
        return (json.dumps({"attempt": attempt, "stream": True}).encode(),
                {"x-inferscale-attempt": attempt})

    rewritten = _Rewritten(json.dumps({"attempt": "kept", "stream": True}).encode(),
                           {"x-inferscale-attempt": "kept"},
                           AutoRecompute(0.5, None, 2, text_threshold, 0.1), retry)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def client_receive():
        await asyncio.Event().wait()  # the client stays connected

    client = Downstream(client_receive)
    before = {o: _count(o) for o in ("kept", "recomputed", "text")}
    try:
        await frontend._answer_auto(SCOPE, client, send, rewritten)
    finally:
        client.close()
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1 and starts[0]["status"] == 200
    headers = {k.decode(): v.decode() for k, v in starts[0]["headers"]}
    assert headers["x-inferscale-recompute-auto"] == outcome
    assert headers["x-inferscale-attempt"] == outcome  # the answering attempt's own headers
    assert {k: v for k, v in headers.items() if k.endswith("-margin")} == margin_headers
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    events = [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    assert "".join(e["choices"][0]["delta"]["content"] for e in events) == (
        f"{outcome}:one {outcome}:two")
    assert body.endswith(b"data: [DONE]\n\n")
    if outcome != "text" and text_threshold:  # a gate read it: the client asked for none
        assert all(e["choices"][0]["logprobs"] is None for e in events)
    skipped = margins["kept"] < 0.1
    expected = {"kept": [], "recomputed": [("recomputed", text_threshold > 0)],
                "text": [("text", False)] if skipped
                else [("recomputed", True), ("text", False)]}[outcome]
    assert asked == expected
    assert {o: _count(o) - before[o] for o in before} == {
        o: float(o == outcome) for o in before}


@pytest.mark.parametrize(("margins", "outcome", "asked"), [
    ({"kept": 0.9}, "kept", [("kept", 1), ("kept", 64)]),
    ({"kept": 0.1, "recomputed": 0.5}, "recomputed",
     [("kept", 1), ("recomputed", 1), ("recomputed", 64)]),
    ({"kept": 0.1, "recomputed": 0.0, "text": 0.0}, "text",
     [("kept", 1), ("recomputed", 1), ("text", 64)]),
    ({"kept": 0.05, "text": 0.0}, "text", [("kept", 1), ("text", 64)]),  # under direct: no tail
])
async def test_non_streamed_attempts_are_decided_by_a_one_token_probe(margins, outcome, asked):
    """Each gated attempt is first asked for one token; only the one that answers generates
    its ``max_tokens``, and the client gets that one response."""
    engine = _engine(margins)
    seen: list[tuple[str, int]] = []

    async def recording(scope, receive, send):
        body = json.loads((await receive())["body"])
        seen.append((body["attempt"], body["max_tokens"]))

        async def again():
            return {"type": "http.request", "body": json.dumps(body).encode(),
                    "more_body": False}
        await engine(scope, again, send)

    frontend = MemoryFrontend(recording)

    async def retry(tail_only: bool, gated: bool) -> tuple[bytes, dict[str, str]]:
        attempt = "recomputed" if tail_only else "text"
        return (json.dumps({"attempt": attempt, "max_tokens": 64}).encode(),
                {"x-inferscale-attempt": attempt})

    rewritten = _Rewritten(json.dumps({"attempt": "kept", "max_tokens": 64}).encode(),
                           {"x-inferscale-attempt": "kept"},
                           AutoRecompute(0.5, None, 2, 0.125, 0.1), retry)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def client_receive():
        await asyncio.Event().wait()

    client = Downstream(client_receive)
    try:
        await frontend._answer_auto(SCOPE, client, send, rewritten)
    finally:
        client.close()
    assert seen == asked
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1
    assert dict(starts[0]["headers"])[b"x-inferscale-recompute-auto"] == outcome.encode()
