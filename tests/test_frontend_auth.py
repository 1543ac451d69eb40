"""Who may read a memory: the front end's key check runs before any retrieval (pure logic)."""

import json

import pytest

from inferscale.frontend import MemoryFrontend
from inferscale.settings import Settings


async def _downstream(scope, receive, send):
    message = await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": message["body"]})


async def _call(frontend, body: dict, headers: dict[str, str]) -> tuple[int, dict]:
    sent = []
    raw = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    await frontend(scope, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"])


@pytest.fixture
def frontend():
    app = MemoryFrontend(_downstream)
    app.settings = Settings(api_keys={"key-a": ["alice"], "key-admin": ["*"]})
    return app


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("headers", "owner", "status"), [
    ({}, "alice", 401),
    ({"authorization": "Bearer nope"}, "alice", 401),
    ({"authorization": "Bearer key-a"}, "bob", 403),
    ({"authorization": "Bearer key-a", "x-inferscale-user": "bob"}, "alice", 403),
])
async def test_keys_that_may_not_act_for_owner_are_refused(frontend, headers, owner, status):
    code, body = await _call(frontend, {**CHAT, "user": owner}, headers)
    assert code == status
    assert body["error"]["message"]
    assert frontend._runtime is None  # no retrieval machinery was even created


async def test_requests_without_owner_pass_untouched(frontend):
    code, body = await _call(frontend, CHAT, {})
    assert code == 200 and body == CHAT
