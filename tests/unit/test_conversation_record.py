"""Memory that records its own conversations (pure logic over ASGI messages and turns): which
turns a request records, under which ids, and only once its answer has completed with 200."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferscale.core.settings import Settings
from inferscale.serving.conversation_record import (
    MAX_ANSWER_BYTES,
    AnswerCapture,
    Recording,
    answer_text,
    new_messages,
    request_id,
)
from inferscale.serving.guards import FrontendError
from inferscale.serving.request_options import MemoryOptions, owner_and_options


def _options(**given) -> MemoryOptions:
    return MemoryOptions.model_validate({"mode": "inject", "k": 5, **given})


def _chunk(text: str) -> bytes:
    event = {"choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def _play(messages: list[dict]) -> tuple[list[dict], list[str]]:
    sent, done = [], []

    async def send(message):
        sent.append(message)

    capture = AnswerCapture(send, done.append)
    for message in messages:
        await capture(message)
    return sent, done


def _start(status=200, streamed=True) -> dict:
    kind = b"text/event-stream" if streamed else b"application/json"
    return {"type": "http.response.start", "status": status,
            "headers": [(b"content-type", kind)]}


def _body(body: bytes, more=False) -> dict:
    return {"type": "http.response.body", "body": body, "more_body": more}


async def test_a_completed_stream_is_recorded_and_passed_through_untouched():
    messages = [_start(), _body(_chunk("Your horse "), True), _body(_chunk("is Biscuit."), True),
                _body(b"data: [DONE]\n\n")]
    sent, done = await _play(messages)
    assert sent == messages and done == ["Your horse is Biscuit."]


async def test_a_whole_answer_is_recorded():
    body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Biscuit."}}]})
    _, done = await _play([_start(streamed=False), _body(body.encode())])
    assert done == ["Biscuit."]


def _response(text: str) -> dict:
    return {"id": "resp_1", "object": "response", "status": "completed",
            "output": [{"type": "reasoning", "content": []},
                       {"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": text, "logprobs": []}]}]}


def _event(payload: dict) -> bytes:
    return f"event: {payload['type']}\ndata: ".encode() + json.dumps(payload).encode() + b"\n\n"


async def test_a_response_is_recorded_whole_or_from_its_completed_event():
    """The Responses API: a whole response's message text; of a stream, the text of its
    ``response.completed`` event (a stream without one was cut short)."""
    _, done = await _play([_start(streamed=False),
                           _body(json.dumps(_response("Biscuit.")).encode())])
    assert done == ["Biscuit."]
    deltas = [_event({"type": "response.output_text.delta", "delta": d, "logprobs": []})
              for d in ("Bis", "cuit.")]
    completed = _event({"type": "response.completed", "response": _response("Biscuit.")})
    _, done = await _play([_start(), *(_body(d, True) for d in deltas), _body(completed)])
    assert done == ["Biscuit."]
    _, done = await _play([_start(), *(_body(d, True) for d in deltas), _body(b"")])
    assert done == []


@pytest.mark.parametrize("messages", [
    [_start(), _body(_chunk("cut "), True), _body(b"")],  # no [DONE]: a stream cut short
    [_start(), _body(_chunk("not over yet"), True)],  # the client went away
    [_start(status=400, streamed=False), _body(b'{"error": "bad"}')],
    [_start(streamed=False), _body(b'{"choices": []}')],  # no answer in it
    [_start(streamed=False), _body(b'{"choices": [{"message": {"content": ""}}]}')],
    [_start(), _body(b"x" * (MAX_ANSWER_BYTES + 1), True), _body(b"data: [DONE]\n\n")],
])
async def test_nothing_is_recorded_without_a_whole_answer(messages):
    sent, done = await _play(messages)
    assert sent == messages and done == []


@given(st.binary(max_size=300), st.booleans())
def test_any_body_gives_text_or_none(body, streamed):
    got = answer_text(body, streamed)
    assert got is None or (isinstance(got, str) and got)


def test_the_new_messages_are_those_after_the_last_answer():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "I moved."},
            {"role": "user", "content": "To Porto."}]
    assert new_messages(chat) == ["I moved.", "To Porto."]
    assert new_messages(chat[:2]) == ["Hi"]


def test_turn_ids_come_from_the_request_id_so_a_retry_records_once():
    scoped = Recording("alice", _options(agent_id="tutor", run_id="s1"), "req-7", ["I moved."])
    turns = scoped.turns("Noted.")
    assert [(t.turn_id, t.speaker, t.text) for t in turns] == [
        ("req-7.u0", "user", "I moved."), ("req-7.a", "assistant", "Noted.")]
    assert {(t.user_id, t.conversation_id, t.agent_id, t.run_id) for t in turns} == {
        ("alice", "s1", "tutor", "s1")}
    assert scoped.headers() == {"x-inferscale-recorded-turns": "req-7.u0,req-7.a",
                                "x-inferscale-recorded-conversation": "s1"}
    assert [t.turn_id for t in Recording("alice", _options(), "req-7", ["x"]).turns("y")] == [
        t.turn_id for t in Recording("alice", _options(), "req-7", ["x"]).turns("y")]
    assert Recording("alice", _options(), "r", []).turns("y")[0].conversation_id == "chat"


@pytest.mark.parametrize("given", ["", "a b", "x" * 129, "a\x07", "é", "a/b"])
def test_a_request_id_that_cannot_name_turns_is_refused(given):
    with pytest.raises(FrontendError) as refused:
        request_id({"x-request-id": given})
    assert refused.value.status == 400 and "X-Request-Id" in refused.value.message


def test_a_request_without_an_id_gets_a_fresh_one():
    assert request_id({}) != request_id({}) and request_id({"x-request-id": "r:1"}) == "r:1"


@pytest.mark.parametrize(("data", "headers", "server", "expected"), [
    ({}, {}, False, False),
    ({}, {}, True, True),
    ({"inferscale": {"record": True}}, {}, False, True),
    ({"inferscale": {"record": False}}, {}, True, False),
    ({}, {"x-inferscale-record": "true"}, False, True),
    ({}, {"x-inferscale-record": "0"}, True, False),
])
def test_record_is_a_request_option_over_the_servers_default(data, headers, server, expected):
    _, options = owner_and_options({"user": "alice", **data}, headers,
                                   Settings(record_conversations=server))
    assert options.record is expected


@pytest.mark.parametrize(("data", "key", "server", "expected"), [
    ({}, None, True, True),
    ({}, True, False, True),
    ({}, False, True, False),
    ({"inferscale": {"record": False}}, True, True, False),
    ({"inferscale": {"record": True}}, False, False, True),
])
def test_a_keys_default_is_between_the_request_and_the_server(data, key, server, expected):
    _, options = owner_and_options({"user": "alice", **data}, {},
                                   Settings(record_conversations=server), key)
    assert options.record is expected


def test_a_key_grant_takes_record_as_a_flag_and_never_with_read_only():
    from pydantic import ValidationError

    from inferscale.core.settings import KeyGrant

    assert KeyGrant(owners=["*"], record=True).record is True
    assert KeyGrant(owners=["*"]).record is None
    for bad in ({"record": "yes"}, {"record": 1}, {"record": True, "read_only": True}):
        with pytest.raises(ValidationError):
            KeyGrant(owners=["*"], **bad)


@pytest.mark.parametrize("value", ["yes", 2, "maybe", [True]])
def test_a_record_that_is_not_a_flag_is_a_400_naming_it(value):
    with pytest.raises(FrontendError) as refused:
        owner_and_options({"user": "alice", "inferscale": {"record": value}}, {}, Settings())
    assert refused.value.status == 400 and "record" in refused.value.message


async def test_publishing_happens_after_the_answer_and_a_failure_never_reaches_it(monkeypatch):
    """Through the front end's recorder: the turns go out once the answer is whole; a broker
    that refuses them at first delays them (retried), and the client's response is unchanged."""
    from inferscale.serving import frontend as module
    from inferscale.serving.frontend import MemoryFrontend

    published: list[list] = []
    refusals = {"bob": 2}

    async def publish(_service, turns):
        published.append(turns)
        if refusals.get(turns[0].user_id, 0) > 0:
            refusals[turns[0].user_id] -= 1
            raise ConnectionError("no broker")

    monkeypatch.setattr(module, "publish_turns", publish)

    async def go(owner: str) -> list[dict]:
        front = MemoryFrontend(None)
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        recorder = front._recorder(send, Recording(owner, _options(), "r1", ["I moved."]))
        for message in [_start(), _body(_chunk("Noted."), True), _body(b"data: [DONE]\n\n")]:
            assert not published or published[-1][0].user_id != owner  # not before the end
            await recorder(message)
        assert await front.recordings.close(grace_s=10) == 0
        return sent

    sent = await go("alice")
    headers = dict(sent[0]["headers"])
    assert headers[b"x-inferscale-recorded-turns"] == b"r1.u0,r1.a"
    assert [t.text for t in published[0]] == ["I moved.", "Noted."]
    refused = await go("bob")
    assert [m["type"] for m in refused] == [m["type"] for m in sent]
    assert [turns[0].user_id for turns in published] == ["alice", "bob", "bob", "bob"]
