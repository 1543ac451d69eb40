"""Recompute auto's gate (pure logic over ASGI messages): a response is released only once its
first token's margin is known and confident, with the logprobs the client did not ask for
removed; an unsure one reaches the client not at all; and no stream, however it is cut,
releases a byte before the decision or loses one after it."""

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.serving.auto_recompute import (
    AutoRecompute,
    FirstTokenGate,
    ask_for_margin,
    client_top_logprobs,
    first_margin,
    one_token,
    strip_logprobs,
)

SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
JSON = [(b"content-type", b"application/json"), (b"content-length", b"999")]


def chunk(token: str | None, top: list[float] | None = None) -> dict:
    """A chat completion chunk: the role chunk (no token), or one token with its top logprobs."""
    if token is None:
        return {"choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None}]}
    entries = [{"token": f"t{i}", "logprob": lp} for i, lp in enumerate(top or [])]
    return {"choices": [{"index": 0, "delta": {"content": token},
                         "logprobs": {"content": [{"token": token, "logprob": (top or [0])[0],
                                                   "top_logprobs": entries}]}}]}


def sse(*payloads: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads) + \
        b"data: [DONE]\n\n"


def run_gate(auto: AutoRecompute, start_headers, body: bytes, cuts: list[int]):
    """Feed ``body`` to a gate in pieces cut at ``cuts``; returns (gate, messages released,
    whether the gate abandoned the attempt before the body's end)."""
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    gate = FirstTokenGate(auto, send, lambda decision, margin: {"x-decision": decision})

    async def go() -> bool:
        await gate({"type": "http.response.start", "status": 200, "headers": start_headers})
        bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(body))), len(body)]
        abandoned_early = False
        for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            more = i < len(bounds) - 2
            await gate({"type": "http.response.body", "body": body[a:b], "more_body": more})
            abandoned_early |= gate.abandoned and more
        return abandoned_early

    return gate, sent, asyncio.run(go())


def released_events(sent: list[dict]) -> list[dict | bytes]:
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    out = []
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {"):
            out.append(json.loads(event[6:]))
        elif event:
            out.append(event)
    return out


AUTO = AutoRecompute(threshold=0.5, client_top_logprobs=None, tail=2)


def test_margin_of_the_first_generated_token():
    assert first_margin(chunk(None)) is None
    assert first_margin(chunk("Hi", [-0.1, -2.1])) == pytest.approx(2.0)
    assert first_margin(chunk("Hi", [-0.3])) == float("inf")
    assert first_margin({"choices": "nope"}) is None
    assert first_margin({"choices": [{"logprobs": {"content": [{"top_logprobs": []}]}}]}) is None


def test_the_request_asks_for_what_the_decision_needs_and_the_client_gets_what_it_asked():
    data = {"messages": []}
    assert client_top_logprobs(data) is None
    ask_for_margin(data)
    assert data["logprobs"] is True and data["top_logprobs"] == 2
    asked = {"logprobs": True, "top_logprobs": 5}
    assert client_top_logprobs(asked) == 5
    ask_for_margin(asked)
    assert asked["top_logprobs"] == 5
    assert strip_logprobs(chunk("a", [-1, -2]), None)["choices"][0]["logprobs"] is None
    trimmed = strip_logprobs(chunk("a", [-1, -2, -3]), 1)
    assert len(trimmed["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 1


def test_a_confident_stream_is_released_whole_without_logprobs():
    body = sse(chunk(None), chunk("Pick", [-0.1, -1.0]), chunk("les", [-0.2, -3.0]))
    gate, sent, early = run_gate(AUTO, SSE, body, [])
    assert (gate.decision, early) == ("kept", False)
    assert sent[0]["type"] == "http.response.start"
    assert (b"x-decision", b"kept") in sent[0]["headers"]
    events = released_events(sent)
    assert [e["choices"][0]["delta"] for e in events[:3]] == [
        {"role": "assistant"}, {"content": "Pick"}, {"content": "les"}]
    assert all(e["choices"][0]["logprobs"] is None for e in events[:3])
    assert events[3] == b"data: [DONE]" and sent[-1]["more_body"] is False


def test_an_unsure_stream_releases_nothing_and_is_abandoned_at_its_first_token():
    body = sse(chunk(None), chunk("Bis", [-0.6, -0.7]), chunk("cuit", [-0.1, -5.0]))
    gate, sent, early = run_gate(AUTO, SSE, body, [10, len(body) - 20])
    assert (gate.decision, gate.abandoned, early, sent) == ("recomputed", True, True, [])
    assert gate.margin == pytest.approx(0.1)


def test_a_non_streamed_answer_is_decided_on_its_whole_body():
    answer = chunk("Pickles", [-0.05, -2.0])
    gate, sent, _ = run_gate(AUTO, JSON, json.dumps(answer).encode(), [7])
    assert gate.decision == "kept"
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(body)).encode()
    assert json.loads(body)["choices"][0]["logprobs"] is None
    unsure = chunk("Pickles", [-0.3, -0.4])
    gate, sent, early = run_gate(AUTO, JSON, json.dumps(unsure).encode(), [])
    assert (gate.decision, sent, early) == ("recomputed", [], False)  # decided at its end


def test_errors_and_answers_without_a_token_pass_through():
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    gate = FirstTokenGate(AUTO, send, lambda *_: {})

    async def go():
        await gate({"type": "http.response.start", "status": 400, "headers": JSON})
        await gate({"type": "http.response.body", "body": b'{"error": 1}', "more_body": False})

    asyncio.run(go())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    gate, sent, _ = run_gate(AUTO, SSE, sse(chunk(None)), [])
    assert gate.decision == "kept" and released_events(sent)[0]["choices"][0]["delta"] == {
        "role": "assistant"}


@settings(max_examples=200, deadline=None)
@given(margins=st.lists(st.floats(0, 5), min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 2000), max_size=8),
       asked=st.none() | st.integers(0, 3))
def test_any_cut_of_a_stream_releases_nothing_before_and_everything_after_the_decision(
        margins, cuts, asked):
    auto = AutoRecompute(threshold=0.5, client_top_logprobs=asked, tail=2)
    tokens = [chunk(f"w{i}", [-0.1, -0.1 - m, -9.0]) for i, m in enumerate(margins)]
    gate, sent, _ = run_gate(auto, SSE, sse(chunk(None), *tokens), cuts)
    if first_margin(tokens[0]) < 0.5:
        assert (gate.decision, sent) == ("recomputed", [])
        return
    assert gate.decision == "kept"
    events = released_events(sent)
    assert [e["choices"][0]["delta"] for e in events[1:-1]] == [
        {"content": f"w{i}"} for i in range(len(margins))]
    for event in events[1:-1]:
        logprobs = event["choices"][0]["logprobs"]
        if asked is None:
            assert logprobs is None
        else:
            assert len(logprobs["content"][0]["top_logprobs"]) == min(asked, 3)


def test_the_tail_recomputed_attempt_is_gated_only_where_a_text_margin_is_set():
    """The second attempt's gate takes the text threshold (and has no third gate after it);
    without a text threshold the second attempt answers as it comes."""
    auto = AutoRecompute(0.5, 3, 2, text_threshold=0.125)
    second = auto.then()
    assert second is not None
    assert (second.threshold, second.client_top_logprobs, second.tail) == (0.125, 3, 2)
    assert second.then() is None
    assert AutoRecompute(0.5, None, 2).then() is None
    # A tie at the second attempt abandons it; a clear answer is released.
    tie = sse(chunk("a", [-0.7, -0.7]))
    gate, sent, _ = run_gate(second, SSE, tie, [])
    assert (gate.decision, sent) == ("recomputed", [])
    gate, sent, _ = run_gate(second, SSE, sse(chunk("a", [-0.1, -2.0])), [])
    assert gate.decision == "kept" and sent


# The Responses API's shapes (vLLM's): events named by an ``event:`` line, logprobs asked for
# by ``include``, the first token in a text delta event or the response's first message part.
def delta(token: str, top: list[float]) -> dict:
    entries = [{"token": f"t{i}", "logprob": lp, "bytes": []} for i, lp in enumerate(top)]
    return {"type": "response.output_text.delta", "delta": token, "item_id": "msg_1",
            "output_index": 0, "content_index": 0, "sequence_number": 3,
            "logprobs": [{"token": token, "logprob": top[0], "top_logprobs": entries}]}


def response(text: str, top: list[float] | None, top_logprobs: int = 2) -> dict:
    entries = [{"token": f"t{i}", "logprob": lp} for i, lp in enumerate(top or [])]
    logprobs = [{"token": text, "logprob": (top or [0])[0], "top_logprobs": entries}] if top \
        else []
    return {"id": "resp_1", "object": "response", "top_logprobs": top_logprobs,
            "output": [{"type": "reasoning", "content": []},
                       {"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": text,
                                     "logprobs": logprobs}]}]}


def named_sse(*payloads: dict) -> bytes:
    return b"".join(f"event: {p['type']}\ndata: ".encode() + json.dumps(p).encode() + b"\n\n"
                    for p in payloads)


def test_the_responses_api_asks_for_logprobs_by_include_and_reads_them_where_it_puts_them():
    data = {"input": "hi", "include": ["reasoning.encrypted_content"]}
    assert client_top_logprobs(data, "responses") is None
    ask_for_margin(data, "responses")
    assert data["include"] == ["reasoning.encrypted_content", "message.output_text.logprobs"]
    assert data["top_logprobs"] == 2 and "logprobs" not in data
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 4}
    assert client_top_logprobs(asked, "responses") == 4
    ask_for_margin(asked, "responses")
    assert asked == {"include": ["message.output_text.logprobs"], "top_logprobs": 4}
    assert json.loads(one_token(json.dumps({"input": "x"}).encode(), "responses") or b"")[
        "max_output_tokens"] == 1
    assert one_token(json.dumps({"input": "x", "stream": True}).encode(), "responses") is None
    assert first_margin(delta("Hi", [-0.1, -2.1])) == pytest.approx(2.0)
    assert first_margin(response("Hi", [-0.2, -0.3])) == pytest.approx(0.1)
    assert first_margin(response("Hi", None)) is None
    assert first_margin({"type": "response.created", "response": response("", None)}) is None
    assert first_margin({"object": "response", "output": "nope"}) is None


def test_a_confident_response_stream_is_released_with_its_event_names_and_without_logprobs():
    created = {"type": "response.created", "sequence_number": 0,
               "response": {**response("", None), "output": []}}
    done = {"type": "response.completed", "sequence_number": 9,
            "response": response("Pickles", [-0.1, -2.0])}
    body = named_sse(created, delta("Pick", [-0.1, -2.0]), delta("les", [-0.3, -0.4]), done)
    auto = AutoRecompute(threshold=0.5, client_top_logprobs=None, tail=2, api="responses")
    gate, sent, _ = run_gate(auto, SSE, body, [5, 200, 400])
    assert gate.decision == "kept" and gate.margin == pytest.approx(1.9)
    released = b"".join(m.get("body", b"") for m in sent[1:]).split(b"\n\n")
    names = [e.split(b"\n")[0] for e in released if e]
    assert names == [b"event: response.created", b"event: response.output_text.delta",
                     b"event: response.output_text.delta", b"event: response.completed"]
    payloads = [json.loads(e.split(b"\n")[1][len(b"data: "):]) for e in released if e]
    assert all(p["logprobs"] == [] for p in payloads[1:3])
    final = payloads[3]["response"]
    assert final["top_logprobs"] == 0 and final["output"][1]["content"][0]["logprobs"] == []
    unsure = named_sse(created, delta("Bis", [-0.6, -0.7]), done)
    gate, sent, _ = run_gate(auto, SSE, unsure, [30])
    assert (gate.decision, sent) == ("recomputed", [])


def test_a_non_streamed_response_keeps_the_top_logprobs_the_client_asked_for():
    auto = AutoRecompute(threshold=0.5, client_top_logprobs=1, tail=2, api="responses")
    gate, sent, _ = run_gate(auto, JSON, json.dumps(response("Hi", [-0.1, -3.0])).encode(), [])
    assert gate.decision == "kept"
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    entry = body["output"][1]["content"][0]["logprobs"][0]
    assert len(entry["top_logprobs"]) == 1 and body["top_logprobs"] == 1
